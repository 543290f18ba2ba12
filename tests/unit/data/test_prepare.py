"""`leantune prepare`: cleaning rules, readers, rejected rows, dedup, batching, cache, training."""

from __future__ import annotations

import csv
import gzip
import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import chat_rows, make_config, write_jsonl

from leantune.cli.app import main
from leantune.data.dataset import PreparedData, load_prepared, prepared_data
from leantune.data.formats import Record, read_records
from leantune.data.packing import pack_examples
from leantune.data.prepare import records as records_module
from leantune.data.prepare.clean import RULES, check_rules, clean_text, strip_html
from leantune.data.prepare.dedup import DedupIndex, minhash, record_text
from leantune.data.prepare.pipeline import prepare_dataset
from leantune.data.prepare.records import PrepareSettings, encode_batch
from leantune.data.prepare.shards import best_fit_decreasing, read_examples
from leantune.data.tokenize import encode_record

ALL = check_rules(RULES)


def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def settings(**kw) -> PrepareSettings:
    return PrepareSettings(**{"format": "chat", "max_seq_len": 128, **kw})


def rejected(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]


# --- cleaning rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "a < b & c",
        "if x<y and y>z then",
        "AT&T and R&D",
        "1<2 and 3 > 2",
        "I <3 this",
        "&copy 2024 and ?a=1&para=2",
        "tail <",
        "x </ y",
        "a <![foo b",  # html.parser raised AssertionError on an unknown marked section
        "<![ x",
    ],
)
def test_text_merely_containing_lt_or_amp_survives_every_rule(text: str) -> None:
    assert clean_text(text, ALL) == text


def test_html_tags_entities_comments_and_scripts_are_removed() -> None:
    html = "<p>Hello&nbsp;<b>world</b> &amp; &lt;you&gt; &#169;</p><!-- c --><script>x=1<2</script>"
    assert strip_html(html) == "\nHello\xa0world & <you> ©\n"
    assert clean_text(html + "<br/>next", ALL) == "Hello world & <you> ©\n\nnext"


def test_control_and_zero_width_removed_but_zwj_kept() -> None:
    family = "👨\u200d👩\u200d👧"
    noisy = f"a\u200bb\x07c\ufeff\r\nd\u00ad {family}"
    assert clean_text(noisy, ("control",)) == f"abc\nd {family}"


def test_nfkc_folds_compatibility_forms() -> None:
    assert clean_text("ｆｕｌｌ ﬁne ①", ("nfkc",)) == "full fine 1"


def test_whitespace_collapses_runs_but_keeps_indentation() -> None:
    text = "  a   b \t c  \n\n\n\ndef f():\n    return 1   \n"
    assert clean_text(text, ("whitespace",)) == "a b c\n\ndef f():\n    return 1"


def test_every_script_and_emoji_survives_all_rules() -> None:
    text = "中文测试 Привет мир 👨\u200d👩\u200d👧 🎉 العربية हिन्दी 日本語のテキスト 한국어"
    assert clean_text(text, ALL) == text


@pytest.mark.parametrize(
    ("rule", "noisy", "cleaned"),
    [
        ("html", "<i>hi</i>", "hi"),
        ("control", "h\u200bi", "hi"),
        ("nfkc", "ｈｉ", "hi"),
        ("whitespace", "h  i ", "h i"),
    ],
)
def test_each_rule_can_be_switched_off(rule: str, noisy: str, cleaned: str) -> None:
    others = tuple(r for r in ALL if r != rule)
    assert clean_text(noisy, (rule,)) == cleaned
    assert clean_text(noisy, others) != cleaned  # without the rule the noise stays
    changed: dict[str, int] = {}
    clean_text(noisy, ALL, changed)
    assert changed.get(rule) == 1


def test_unknown_rule_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown cleaning rule"):
        check_rules(["html", "lowercase"])


def test_every_text_field_of_each_format_is_cleaned(tmp_path: Path, tokenizer) -> None:
    cases = {
        "chat": {
            "messages": [
                {"role": "system", "content": "<b>Sys</b>"},
                {"role": "user", "content": "q\u200b1"},
                {"role": "assistant", "content": "ａ  1"},
            ]
        },
        "alpaca": {"instruction": "<p>Do</p>", "input": "x&amp;y", "output": "ｏｋ"},
        "text": {"text": "<div>one</div>two"},
    }
    expected = {
        "chat": [["system", "Sys"], ["user", "q1"], ["assistant", "a 1"]],
        "alpaca": [["user", "Do\n\nx&y"], ["assistant", "ok"]],
        "text": "one\ntwo",
    }
    for fmt, row in cases.items():
        path = write_jsonl(tmp_path / f"{fmt}.jsonl", [row])
        out = tmp_path / f"{fmt}.out"
        prepare_dataset([str(path)], settings(format=fmt, clean=RULES), tokenizer, out)
        table = read_examples(out)
        if fmt == "text":
            assert table.column("text").to_pylist() == [expected["text"]]
        else:
            msgs = json.loads(table.column("messages")[0].as_py())["messages"]
            assert [[m["role"], m["content"]] for m in msgs] == expected[fmt]
        assert table.schema.field(table.column_names[2]).type == pa.string()


# --- readers and rejected rows ----------------------------------------------------------------


def test_every_bad_line_class_is_rejected_with_file_line_and_reason(
    tmp_path: Path, tokenizer
) -> None:
    good = json.dumps(chat("q", "a"))
    lines = [
        good.encode(),  # 1
        b"{not json",  # 2 invalid JSON
        b'{"text": "wrong field"}',  # 3 missing field
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',  # 4 not UTF-8
        b"",  # 5 empty line
        b'["a list"]',  # 6 JSON that is not an object
        json.dumps(chat("q", "  ")).encode(),  # 7 empty answer
        json.dumps(chat("q", "<p></p>")).encode(),  # 8 empty after cleaning
        json.dumps(chat("q", "long " * 300)).encode(),  # 9 too long
        good.encode(),  # 10 exact duplicate of 1
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out"
    report = prepare_dataset([str(path)], settings(clean=RULES, dedup="exact"), tokenizer, out)
    rows = rejected(out)
    assert [(r["line"], r["kind"]) for r in rows] == [
        (2, "invalid_json"),
        (3, "missing_field"),
        (4, "not_utf8"),
        (5, "empty_line"),
        (6, "not_object"),
        (7, "empty_field"),
        (8, "empty_after_cleaning"),
        (9, "too_long"),
        (10, "exact_duplicate"),
    ]
    assert all(r["file"] == str(path) for r in rows)
    assert rows[0]["reason"].startswith("invalid JSON")
    assert rows[1]["reason"] == "missing field 'messages'"
    assert rows[2]["reason"] == f"not valid UTF-8 (byte {lines[3].index(0xE9)})"
    assert rows[4]["reason"] == "expected a JSON object, got list"
    assert (
        rows[7]["reason"].startswith("too long: ") and "data.max_seq_len=128" in rows[7]["reason"]
    )
    assert rows[8]["duplicate_of"] == f"{path}:1"
    assert report["rows_in"] == 10 and report["rows_out"] == 1
    assert sum(report["dropped"].values()) == 9
    assert report["dropped"]["exact_duplicate"] == 1
    on_disk = json.loads((out / "prepare_report.json").read_text())
    assert on_disk["dropped"] == report["dropped"] and 0 < on_disk["packing_efficiency"] <= 1


def test_answer_truncated_to_nothing_is_dropped_and_counted(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [chat("hello " * 60, "the answer"), chat("short question " * 5, "yes " * 60)],
    )
    out = tmp_path / "out"
    report = prepare_dataset([str(path)], settings(max_seq_len=64, truncate=True), tokenizer, out)
    assert report["dropped"] == {"answer_truncated": 1}
    [row] = rejected(out)
    assert row["line"] == 1 and row["reason"].startswith("answer truncated to nothing")
    table = read_examples(out)
    assert table.column("line").to_pylist() == [2]
    [ids] = table.column("input_ids").to_pylist()
    [labels] = table.column("labels").to_pylist()
    assert len(ids) == 64 and labels[-1] == -100 and any(x != -100 for x in labels)


def _write_all_kinds(tmp_path: Path, rows: list[dict]) -> dict[str, Path]:
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    paths = {k: tmp_path / f"d.{k}" for k in ("jsonl", "jsonl.gz", "jsonl.zst", "json", "csv")}
    paths["jsonl"].write_bytes(lines)
    paths["jsonl.gz"].write_bytes(gzip.compress(lines))
    paths["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(lines))
    paths["json"].write_text(json.dumps(rows, indent=1))
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        for r in rows:
            w.writerow([json.dumps(r["messages"])])
    paths["parquet"] = tmp_path / "d.parquet"
    flat = [{"messages": r["messages"]} for r in rows]
    pq.write_table(pa.Table.from_pylist(flat), paths["parquet"])
    return paths


def test_every_reader_gives_the_same_examples(tmp_path: Path, tokenizer) -> None:
    rows = [chat(f"multi\nline question {i}", f"answer {i}") for i in range(5)]
    paths = _write_all_kinds(tmp_path, rows)
    results = {}
    for kind, path in paths.items():
        out = tmp_path / f"out-{kind}"
        report = prepare_dataset([str(path)], settings(), tokenizer, out)
        assert report["rows_in"] == 5 and report["dropped"] == {}, kind
        results[kind] = read_examples(out)
    ref = results["jsonl"]
    for kind, table in results.items():
        assert table.column("input_ids").equals(ref.column("input_ids")), kind
        assert table.column("messages").equals(ref.column("messages")), kind
    assert results["jsonl"].column("line").to_pylist() == [1, 2, 3, 4, 5]
    assert results["parquet"].column("line").to_pylist() == [1, 2, 3, 4, 5]
    assert results["csv"].column("line").to_pylist() == [2, 3, 4, 5, 6]
    # JSON array: the line each element starts on (indent=1 puts 16 lines per element).
    lines = results["json"].column("line").to_pylist()
    text = paths["json"].read_text().splitlines()
    assert all(text[n - 1].strip() == "{" for n in lines) and len(set(lines)) == 5


def test_bad_line_in_a_gzip_file_names_its_line(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "g.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": 3}\n'))
    out = tmp_path / "out"
    prepare_dataset([str(path)], settings(format="text"), tokenizer, out)
    assert [(r["line"], r["reason"]) for r in rejected(out)] == [
        (2, "field 'text' must be a string, got int")
    ]


# --- dedup ------------------------------------------------------------------------------------


LONG = (
    "Our refund policy: items can be returned within thirty days of delivery when they are "
    "unused and in the original packaging; refunds go back to the original payment method."
)


def test_exact_and_near_duplicates_are_removed_first_occurrence_wins(
    tmp_path: Path, tokenizer
) -> None:
    rows = [
        chat("policy?", LONG),  # 1 kept
        chat("policy?", LONG.replace("  ", " ") + "  "),  # 2 exact duplicate after cleaning
        chat("policy?", LONG.replace("thirty", "thirty-one")),  # 3 near duplicate of 1
        chat("shipping?", "Orders ship within two business days from our warehouse."),  # 4 kept
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    cfg = settings(clean=RULES, dedup="near", max_seq_len=512)
    report = prepare_dataset([str(path)], cfg, tokenizer, out)
    assert read_examples(out).column("line").to_pylist() == [1, 4]
    got = [(r["line"], r["kind"], r["duplicate_of"]) for r in rejected(out)]
    assert got == [(2, "exact_duplicate", f"{path}:1"), (3, "near_duplicate", f"{path}:1")]
    assert report["dropped"] == {"exact_duplicate": 1, "near_duplicate": 1}
    # exact-only mode keeps the near duplicate
    out2 = tmp_path / "out2"
    prepare_dataset(
        [str(path)], settings(clean=RULES, dedup="exact", max_seq_len=512), tokenizer, out2
    )
    assert read_examples(out2).column("line").to_pylist() == [1, 3, 4]


def test_minhash_estimates_jaccard_and_threshold_decides() -> None:
    a = minhash(record_text({"text": LONG}), 64)
    near = minhash(record_text({"text": LONG.replace("thirty", "thirty-one")}), 64)
    other = minhash(record_text({"text": "completely unrelated words about the weather"}), 64)
    assert float(np.mean(a == near)) > 0.8 and float(np.mean(a == other)) < 0.1
    strict = DedupIndex("near", threshold=0.99)
    assert strict.check(0, 1, a) is None and strict.check(1, 2, near) is None
    loose = DedupIndex("near", threshold=0.7)
    assert loose.check(0, 1, a) is None
    verdict = loose.check(1, 2, near)
    assert verdict is not None and verdict.of == 0 and verdict.kind == "near_duplicate"


# --- tokenisation, packing, cache -------------------------------------------------------------


def test_batched_encoding_equals_per_record_encoding(tokenizer) -> None:
    parsed = [
        {"messages": chat("a", "one")["messages"] + chat("b", "two")["messages"]},
        {"messages": [{"role": "system", "content": "s"}, *chat("x", "y")["messages"]]},
        {"text": "plain text here"},
    ]
    batched = encode_batch(tokenizer, parsed)
    for p, (ids, labels) in zip(parsed, batched, strict=True):
        msgs = tuple(p["messages"]) if "messages" in p else None
        ref = encode_record(tokenizer, Record("f", 1, messages=msgs, text=p.get("text")))
        assert ids.tolist() == ref.input_ids and labels.tolist() == ref.labels


def test_best_fit_decreasing_fills_the_tightest_bin() -> None:
    assert best_fit_decreasing([3, 8, 5, 2, 7, 4], 10) == [[1, 3], [4, 0], [2, 5]]
    # The 1 goes into the bin with 1 free (bin 3), not the first bin it fits (bin 0, 2 free):
    # first-fit decreasing would give [[3, 2], [0], [1], [4, 5]].
    assert best_fit_decreasing([7, 7, 1, 8, 5, 4], 10) == [[3], [0], [1], [4, 5, 2]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500).tolist()
    bins = best_fit_decreasing(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 128) + 2  # within 2 bins of the lower bound


def test_rerun_is_a_cache_hit_that_tokenises_nothing(
    tmp_path: Path, tokenizer, monkeypatch
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", f"a{i}") for i in range(6)])
    out = tmp_path / "out"
    first = prepare_dataset([str(path)], settings(), tokenizer, out)
    assert first["cache_hit"] is False
    before = (out / "rows-00000.parquet").read_bytes()

    def no_tokenising(*args, **kwargs):
        raise AssertionError("tokenised again on a cache hit")

    stale = tmp_path / "out.tmp-999999999"  # left by a killed run (no such process)
    stale.mkdir()
    monkeypatch.setattr(records_module, "encode_batch", no_tokenising)
    second = prepare_dataset([str(path)], settings(), tokenizer, out)
    assert second["cache_hit"] is True and second["cache_key"] == first["cache_key"]
    assert json.loads((out / "prepare_report.json").read_text())["cache_hit"] is True
    assert (out / "rows-00000.parquet").read_bytes() == before
    # a changed setting or changed contents is a miss (and would tokenise)
    for changed_settings, changed_file in ((settings(max_seq_len=64), False), (settings(), True)):
        if changed_file:
            write_jsonl(path, [chat("new", "rows")])
        with pytest.raises(AssertionError, match="tokenised again"):
            prepare_dataset([str(path)], changed_settings, tokenizer, out)
        assert not stale.exists()  # a fresh build clears what killed builds left
        assert (out / "rows-00000.parquet").read_bytes() == before  # a failed build changes nothing


def test_a_crashed_preparation_resumes_without_tokenising_finished_chunks(
    tmp_path: Path, tokenizer, monkeypatch
) -> None:
    from leantune.data.prepare import engines

    path = write_jsonl(
        tmp_path / "d.jsonl", [chat(f"question {i} " * 4, f"a{i}") for i in range(40)]
    )
    ref = prepare_dataset([str(path)], settings(), tokenizer, tmp_path / "ref", partition_mb=0.001)
    real = engines.process_chunk
    starts: list[int] = []
    crashes: list[int] = []

    def crash_on_third_chunk(chunk, s, tok):
        starts.append(chunk[0].line)
        if len(starts) == 3 and not crashes:
            crashes.append(1)
            raise RuntimeError("killed")
        return real(chunk, s, tok)

    monkeypatch.setattr(engines, "process_chunk", crash_on_third_chunk)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="killed"):
        prepare_dataset([str(path)], settings(), tokenizer, out, partition_mb=0.001)
    assert not out.exists()
    first_run, starts[:] = list(starts), []
    report = prepare_dataset([str(path)], settings(), tokenizer, out, partition_mb=0.001)
    assert report["engine"]["chunks_reused"] == 2
    assert starts[0] == first_run[2]  # the finished chunks were not tokenised again
    n_chunks = len(list(engines.iter_chunks([str(path)], int(0.001 * 2**20))))
    assert n_chunks >= 4 and len(starts) == n_chunks - 2
    for name in ("examples-00000.parquet", "rows-00000.parquet"):
        assert pq.read_table(out / name).equals(pq.read_table(tmp_path / "ref" / name))
    assert report["rows_out"] == ref["rows_out"] == 40
    assert not list(tmp_path.glob("out.partial-*"))  # removed once the output is complete


def test_chunk_store_round_trips_every_field_compactly(tmp_path: Path) -> None:
    import pickle

    from leantune.data.prepare.chunks import ChunkStore
    from leantune.data.prepare.records import ChunkResult, Kept, Rejection

    rng = np.random.default_rng(0)

    def kept(i: int, shifted: bool, signature: bool) -> Kept:
        ids = rng.integers(0, 49152, size=50 + i, dtype=np.int32)
        labels = np.full(ids.size, -100, dtype=np.int32)
        labels[20:-1] = ids[21:]  # the answer-only labels that leantune.data.tokenize builds
        if not shifted:
            labels[5] = 7  # a label that no mask over the ids can express
        sig = rng.integers(0, 2**32, size=16, dtype=np.uint32) if signature else None
        return Kept(
            f"f{i % 2}.jsonl",
            i + 1,
            f"record {i} \u4e2d\u6587 \U0001f600",
            2**64 - 1 - i,
            sig,
            ids,
            labels,
        )

    for shifted, signature in [(True, False), (False, True)]:
        result = ChunkResult(
            kept=[kept(i, shifted, signature) for i in range(30)],
            rejected=[Rejection("f0.jsonl", 99, "invalid_json", 'line 99: bad "json"')],
            order=[True] * 10 + [False] + [True] * 20,
            cleaned={"html": 3},
            seconds=1.5,
        )
        store = ChunkStore(tmp_path / f"out{shifted}", "k" * 64, 4.0)
        assert store.load(0) is None
        store.save(0, result)
        back = ChunkStore(tmp_path / f"out{shifted}", "k" * 64, 4.0).load(0)
        assert back is not None
        assert (back.rejected, back.order, back.cleaned, back.seconds) == (
            result.rejected,
            result.order,
            result.cleaned,
            result.seconds,
        )
        for a, b in zip(result.kept, back.kept, strict=True):
            assert (a.source, a.line, a.record, a.digest) == (b.source, b.line, b.record, b.digest)
            for x, y in [(a.input_ids, b.input_ids), (a.labels, b.labels)]:
                assert x.dtype == y.dtype and np.array_equal(x, y)
            assert (a.signature is None) == (b.signature is None)
            if a.signature is not None:
                assert np.array_equal(a.signature, b.signature)
        if shifted:  # the label mask costs 1 bit per token instead of 4 bytes
            assert store.disk_bytes() < len(pickle.dumps(result)) / 1.5
    all_rejected = ChunkResult(rejected=[Rejection("f.jsonl", 1, "empty_line", "empty line")])
    all_rejected.order = [False]
    store.save(1, all_rejected)
    assert store.load(1) == all_rejected


def test_cache_key_covers_the_chat_template(tmp_path: Path, tokenizer) -> None:
    from leantune.data.prepare.pipeline import cache_key

    path = write_jsonl(tmp_path / "d.jsonl", [chat("q", "a")])
    other = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    other.chat_template = tokenizer.chat_template.replace("\n", " ")
    assert cache_key([str(path)], settings(), tokenizer) == cache_key(
        [str(path)], settings(), type(tokenizer).from_pretrained(tokenizer.name_or_path)
    )
    assert cache_key([str(path)], settings(), tokenizer) != cache_key(
        [str(path)], settings(), other
    )


# --- training reads it ------------------------------------------------------------------------


def per_record(path: Path, tokenizer, max_seq_len: int, limit: int | None = None) -> PreparedData:
    """The reference for short chat files: `read_records`, `encode_record` one record at a time,
    whole-file packing; with `limit`, the first `limit` records and the bad lines among them."""
    records, bad = read_records(path, "chat")
    if limit is not None:
        records = records[:limit]
        bad = [b for b in bad if b.line <= records[-1].line]
    examples = [encode_record(tokenizer, r) for r in records]
    assert all(len(e.input_ids) <= max_seq_len for e in examples)
    total = len(examples) + len(bad)
    return PreparedData(pack_examples(examples, max_seq_len), examples, records, bad, total)


def test_prepared_dir_gives_the_in_process_examples_and_rows(tmp_path: Path, tokenizer) -> None:
    rows = [chat(f"Order {i} status?", f'{{"id": {i}}}') for i in range(30)]
    path = write_jsonl(tmp_path / "train.jsonl", [*rows, "{broken"])
    reference = per_record(path, tokenizer, 128)
    out = tmp_path / "prepared"
    prepare_dataset([str(path)], settings(), tokenizer, out)
    from_dir = load_prepared(out, max_bad_fraction=0.1)
    kw = {"settings": settings(), "tokenizer": tokenizer, "max_bad_fraction": 0.1}
    cached = prepared_data(path, cache_dir=tmp_path / "cache", **kw)
    uncached = prepared_data(path, **kw)  # eval's and plan's way: a temporary directory
    for data in (from_dir, cached, uncached):
        assert [e.input_ids for e in data.examples] == [e.input_ids for e in reference.examples]
        assert [e.labels for e in data.examples] == [e.labels for e in reference.examples]
        assert data.records == reference.records
        assert [(b.line, b.reason) for b in data.bad] == [(b.line, b.reason) for b in reference.bad]
        assert data.supervised_tokens == reference.supervised_tokens
        # packed rows hold exactly the same tokens, with positions restarting per example
        assert sorted(t for r in data.rows for t in r.input_ids) == sorted(
            t for r in reference.rows for t in r.input_ids
        )
        assert len(data.rows) <= len(pack_examples(reference.examples, 128))
    assert from_dir.rows == cached.rows


def test_train_from_a_prepared_dir_equals_train_from_the_file(
    tmp_path: Path, tiny_llama_dir: Path, tokenizer
) -> None:
    from leantune.training.recipe import train

    path = write_jsonl(tmp_path / "train.jsonl", chat_rows(16))
    out = tmp_path / "prepared"
    prepare_dataset([str(path)], settings(), tokenizer, out)
    losses = []
    for name, data in (("file", path), ("dir", out)):
        cfg = make_config(tiny_llama_dir, data, tmp_path / name, "train.max_steps=2")
        train(cfg, log=lambda m: None)
        metrics = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(m)["loss"] for m in metrics])
    assert losses[0] == losses[1] and len(losses[0]) == 2
    # the file run went through the tokenise-once cache in its run directory
    assert list((tmp_path / "file" / "prepared").glob("*/prepare_report.json"))


def test_cli_prepare_writes_a_directory_and_reports(
    tmp_path: Path, tiny_llama_dir: Path, capsys
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [chat("<b>q</b>", "a"), chat("<b>q</b>", "a"), "[]"])
    out = tmp_path / "out"
    args = ["prepare", "--data", str(path), "--format", "chat", "--model", str(tiny_llama_dir)]
    assert main([*args, "--out", str(out), "--max-seq-len", "64"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rows_in"] == 3 and summary["rows_out"] == 1
    assert summary["dropped"] == {"exact_duplicate": 1, "not_object": 1}
    msgs = json.loads(read_examples(out).column("messages")[0].as_py())["messages"]
    assert msgs[0]["content"] == "q"  # cleaned by default
    assert main([*args, "--out", str(out), "--max-seq-len", "64"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cache_hit"] is True
    assert main(["prepare", "--data", str(path)]) == 2


def test_limit_takes_the_first_records_like_the_reference(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "e.jsonl", [chat(f"q{i}", f"a{i}") for i in range(4)] + ["{x"])
    path.write_text("{x\n" + path.read_text())
    ref = per_record(path, tokenizer, 128, limit=2)
    got = prepared_data(
        path,
        settings=settings(),
        tokenizer=tokenizer,
        cache_dir=tmp_path / "cache",
        max_bad_fraction=0.5,
        limit=2,
    )
    assert got.records == ref.records and [r.line for r in got.records] == [2, 3]
    assert [e.input_ids for e in got.examples] == [e.input_ids for e in ref.examples]
    assert [(b.line, b.reason) for b in got.bad] == [(b.line, b.reason) for b in ref.bad]
    assert got.total_lines == ref.total_lines == 3
    assert sorted(t for r in got.rows for t in r.input_ids) == sorted(
        t for r in ref.rows for t in r.input_ids
    )


def test_without_a_cache_dir_nothing_is_left_behind(
    tmp_path: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [chat("q", "a")])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    data = prepared_data(path, settings=settings(), tokenizer=tokenizer)
    assert len(data.rows) == 1 and list(scratch.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        prepared_data(tmp_path / "missing.jsonl", settings=settings(), tokenizer=tokenizer)
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "scratch"]


def test_prepare_from_a_config_uses_its_data_and_model(
    tmp_path: Path, tiny_llama_dir: Path, capsys
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [chat("<i>q</i>", "a"), chat("q", "a")])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model:\n  path: {tiny_llama_dir}\n"
        "data:\n  train: t.jsonl\n  format: chat\n  max_seq_len: 64\n  clean: [html]\n"
    )
    assert main(["prepare", str(cfg), "data.dedup=exact", "--out", str(tmp_path / "p")]) == 0
    report = json.loads((tmp_path / "p" / "prepare_report.json").read_text())
    assert report["settings"]["clean"] == ["html"] and report["settings"]["max_seq_len"] == 64
    assert report["settings"]["dedup"] == "exact"
    assert report["files"] == [str(path.resolve())]
    assert report["dropped"] == {"exact_duplicate": 1}  # "<i>q</i>" cleans to "q"
