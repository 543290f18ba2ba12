"""Bad input is a line-numbered error (exit 2) or a counted drop, never a traceback.

Each case runs through `leantune prepare`, and where it matters through `leantune train`
(data.train=file) and `leantune eval --data`, with `run_cli`, which fails on any traceback.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support import prepare_rows, run_cli, write_jsonl

from leantune.data.dataset import DataError
from leantune.data.prepare.pipeline import prepare_dataset
from leantune.data.prepare.readers import read_items
from leantune.data.prepare.records import PrepareSettings


def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


GOOD = [chat(f"question {i}", f"answer {i}") for i in range(6)]
DEEP = "[" * 100_000 + "]" * 100_000


def lines(rows: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def rejected(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]


def prepare(path: Path, model: Path, out: Path, fmt: str = "chat", *extra: str):
    args = ["prepare", "--data", str(path), "--format", fmt, "--model", str(model)]
    return run_cli([*args, "--out", str(out), "--clean", "none", "--dedup", "none", *extra])


def train(path: Path, model: Path, run_dir: Path, *extra: str):
    return run_cli(
        [
            "train",
            f"model.path={model}",
            f"data.train={path}",
            "data.format=chat",
            "data.max_seq_len=128",
            f"run.dir={run_dir}",
            "run.progress=false",
            "train.max_steps=1",
            "train.micro_batch_size=2",
            "data.eval=null",
            "train.eval_exact_match=false",
            *extra,
        ]
    )


def evaluate(path: Path, model: Path, *extra: str):
    return run_cli(
        ["eval", "--model", str(model), "--data", str(path), "--max-new-tokens", "2", *extra]
    )


# --- 100k-deep nesting: a counted bad line ----------------------------------------------------


def test_deeply_nested_json_is_a_counted_bad_line(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_bytes(
        lines([GOOD[0], DEEP, json.dumps({"messages": json.loads("[" * 50 + "]" * 50)}), *GOOD[1:]])
    )
    res = prepare(path, tiny_llama_dir, tmp_path / "out")
    assert res.code == 0, res
    rows = rejected(tmp_path / "out")
    assert [(r["line"], r["kind"]) for r in rows] == [(2, "too_deep"), (3, "invalid_record")]
    assert rows[0]["reason"].startswith("nested too deeply")
    data = prepare_rows(path, "chat", _tok(tiny_llama_dir), 128, pack=False, max_bad_fraction=0.5)
    assert data.bad[0].line == 2 and data.bad[0].reason.startswith("nested too deeply")
    res = train(path, tiny_llama_dir, tmp_path / "run", "data.max_bad_fraction=0.5")
    assert res.code == 0 and f"{path}:2: nested too deeply" in res.out, res
    res = evaluate(path, tiny_llama_dir)
    assert res.code == 0 and f"{path}:2: nested too deeply" in res.err, res
    # The default data.max_bad_fraction refuses the file, naming the line.
    res = train(path, tiny_llama_dir, tmp_path / "run2")
    assert res.code == 2 and f"{path}:2: nested too deeply" in res.err, res


def test_deep_nesting_in_a_csv_messages_cell_and_a_json_array(tmp_path: Path, tokenizer) -> None:
    path = tmp_path / "d.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        w.writerow([json.dumps(GOOD[0]["messages"])])
        w.writerow([DEEP])
    report = prepare_dataset([str(path)], PrepareSettings("chat", 128), tokenizer, tmp_path / "o")
    assert report["dropped"] == {"too_deep": 1}
    assert rejected(tmp_path / "o")[0]["line"] == 3
    arr = tmp_path / "d.json"
    arr.write_text("[\n" + json.dumps(GOOD[0]) + ",\n" + DEEP + "\n]")
    with pytest.raises(DataError, match=rf"{arr}:3: nested too deeply"):
        prepare_dataset([str(arr)], PrepareSettings("chat", 128), tokenizer, tmp_path / "o2")


def _tok(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# --- damaged archives: the whole file is refused ---------------------------------------------


def _many_lines() -> bytes:
    return lines([chat(os.urandom(8).hex(), os.urandom(8).hex()) for _ in range(3000)])


def _damaged(tmp_path: Path) -> dict[str, Path]:
    data = _many_lines()
    gz = gzip.compress(data)
    zst = zstandard.ZstdCompressor(write_checksum=True).compress(data)
    flipped = bytearray(zst)
    flipped[len(zst) // 2 : len(zst) // 2 + 16] = b"\x00" * 16
    out = {
        "truncated.jsonl.gz": gz[: len(gz) * 2 // 3],
        "crc.jsonl.gz": gz[:-8] + b"\x00" * 8,
        "truncated.jsonl.zst": zst[: len(zst) * 2 // 3],
        "corrupt.jsonl.zst": bytes(flipped),
        "garbage.jsonl.zst": b"this is not zstd at all\n",
    }
    paths = {}
    for name, blob in out.items():
        (tmp_path / name).write_bytes(blob)
        paths[name] = tmp_path / name
    return paths


def test_damaged_archives_are_refused_naming_the_file_and_last_good_line(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    for name, path in _damaged(tmp_path).items():
        res = prepare(path, tiny_llama_dir, tmp_path / f"{name}.out")
        assert res.code == 2, (name, res)
        assert str(path) in res.err and "refused" in res.err, (name, res.err)
        assert "damaged" in res.err or "truncated" in res.err, (name, res.err)
        if name.endswith(".gz"):  # gzip finds the damage while reading: it names the line
            assert "after line" in res.err, (name, res.err)
        assert not (tmp_path / f"{name}.out").exists()
    path = tmp_path / "truncated.jsonl.gz"
    res = train(path, tiny_llama_dir, tmp_path / "run")
    assert res.code == 2 and str(path) in res.err and "after line" in res.err, res
    res = evaluate(path, tiny_llama_dir)
    assert res.code == 2 and str(path) in res.err and "after line" in res.err, res
    path = tmp_path / "truncated.jsonl.zst"
    res = evaluate(path, tiny_llama_dir)
    assert res.code == 2 and str(path) in res.err and "truncated" in res.err, res


def test_a_zstd_file_of_several_frames_is_read_whole(tmp_path: Path, tokenizer) -> None:
    c = zstandard.ZstdCompressor()
    path = tmp_path / "multi.jsonl.zst"
    path.write_bytes(c.compress(lines(GOOD[:3])) + c.compress(lines(GOOD[3:])))
    assert [i.line for i in read_items(path)] == [1, 2, 3, 4, 5, 6]


# --- not the file its name says --------------------------------------------------------------


def test_a_five_byte_parquet_file_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1x")
    res = prepare(path, tiny_llama_dir, tmp_path / "out")
    assert res.code == 2 and f"{path}: not a Parquet file" in res.err, res
    res = train(path, tiny_llama_dir, tmp_path / "run")
    assert res.code == 2 and f"{path}: not a Parquet file" in res.err, res
    res = evaluate(path, tiny_llama_dir)
    assert res.code == 2 and f"{path}: not a Parquet file" in res.err, res


def test_a_damaged_parquet_file_is_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(GOOD * 50), path)
    blob = bytearray(path.read_bytes())
    blob[4:40] = b"\xff" * 36  # the first page header
    path.write_bytes(bytes(blob))
    res = prepare(path, tiny_llama_dir, tmp_path / "out")
    assert res.code == 2 and str(path) in res.err, res


def test_an_unsupported_suffix_or_a_directory_is_refused(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    path = tmp_path / "d.txt"
    path.write_bytes(lines(GOOD))
    res = prepare(path, tiny_llama_dir, tmp_path / "out")
    assert res.code == 2 and f"{path}: unsupported file type" in res.err, res
    res = train(path, tiny_llama_dir, tmp_path / "run")
    assert res.code == 2 and f"{path}: unsupported file type" in res.err, res
    res = prepare(tmp_path, tiny_llama_dir, tmp_path / "out")
    assert res.code == 2 and "is a directory" in res.err, res


def test_prepare_out_that_is_not_a_prepared_dir_is_refused(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "important.txt").write_text("keep")
    res = prepare(path, tiny_llama_dir, out)
    assert res.code == 2 and f"{out}: exists and is not a prepared directory" in res.err, res
    assert (out / "important.txt").read_text() == "keep"


# --- CSV --------------------------------------------------------------------------------------


def test_bad_csv_rows_are_counted_or_the_file_refused(
    tmp_path: Path, tiny_llama_dir: Path, tokenizer
) -> None:
    s = PrepareSettings("text", 64)
    path = tmp_path / "d.csv"
    path.write_bytes(b'text\nfirst\n"caf\xe9"\nnul\x00byte\nlast\n"' + b"x" * 200_000 + b'"\n')
    report = prepare_dataset([str(path)], s, tokenizer, tmp_path / "o")
    assert report["rows_out"] == 3  # first, the NUL row (as text) and last
    kinds = [(r["line"], r["kind"]) for r in rejected(tmp_path / "o")]
    assert kinds == [(3, "not_utf8"), (6, "too_long")]  # a big field is read, then too long
    wide = tmp_path / "wide.csv"
    wide.write_bytes(b"text\nok\na,b\n")
    report = prepare_dataset([str(wide)], s, tokenizer, tmp_path / "o2")
    assert [(r["line"], r["kind"]) for r in rejected(tmp_path / "o2")] == [(3, "bad_csv_row")]
    unclosed = tmp_path / "unclosed.csv"
    unclosed.write_bytes(b'text\nok\n"never closed\nmore\n')
    res = prepare(unclosed, tiny_llama_dir, tmp_path / "o3", "text")
    assert res.code == 2 and f"{unclosed}:3:" in res.err and "refused" in res.err, res


# --- BOM --------------------------------------------------------------------------------------


def test_a_utf8_bom_does_not_drop_the_first_record(
    tmp_path: Path, tiny_llama_dir: Path, tokenizer
) -> None:
    bom = b"\xef\xbb\xbf"
    body = lines(GOOD)
    files = {
        "d.jsonl": bom + body,
        "d.jsonl.gz": gzip.compress(bom + body),
        "d.jsonl.zst": zstandard.ZstdCompressor().compress(bom + body),
        "d.json": bom + json.dumps(GOOD).encode(),
    }
    with (tmp_path / "plain.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["messages"])
        for r in GOOD:
            w.writerow([json.dumps(r["messages"])])
    files["d.csv"] = bom + (tmp_path / "plain.csv").read_bytes()
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
        report = prepare_dataset(
            [str(tmp_path / name)], PrepareSettings("chat", 128), tokenizer, tmp_path / f"{name}.o"
        )
        assert report["rows_out"] == len(GOOD) and report["dropped"] == {}, name
    data = prepare_rows(tmp_path / "d.jsonl", "chat", tokenizer, 128, pack=False)
    assert len(data.examples) == len(GOOD) and not data.bad
    res = evaluate(tmp_path / "d.jsonl", tiny_llama_dir)  # format detected despite the BOM
    assert res.code == 0 and json.loads(res.out)["format"] == "chat", res


# --- nothing kept -----------------------------------------------------------------------------


def test_prepare_that_keeps_nothing_exits_2_with_the_counts(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl", ["{broken", '{"text": "no messages"}', chat("q", "long " * 300)]
    )
    out = tmp_path / "out"
    res = prepare(path, tiny_llama_dir, out, "chat", "--max-seq-len", "64")
    assert res.code == 2, res
    assert "kept 0 of 3 records" in res.err
    for kind in ("invalid_json 1", "missing_field 1", "too_long 1"):
        assert kind in res.err, res.err
    assert str(out / "rejected.jsonl") in res.err and (out / "rejected.jsonl").is_file()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    res = prepare(empty, tiny_llama_dir, tmp_path / "out2")
    assert res.code == 2 and "kept 0 of 2 records" in res.err, res


# --- values that are not text ----------------------------------------------------------------


def test_lone_surrogates_and_huge_numbers_are_counted_bad_lines(
    tmp_path: Path, tiny_llama_dir: Path, tokenizer
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        lines(GOOD[:2])
        + b'{"messages": [{"role": "user", "content": "a\\ud800b"}, '
        + b'{"role": "assistant", "content": "x"}]}\n'
        + b'{"messages": '
        + b"1" * 5000
        + b"}\n"
        + b'{"messages": [{"role": '
        + json.dumps(["x" * 10_000]).encode()
        + b', "content": "q"}]}\n'
    )
    report = prepare_dataset([str(path)], PrepareSettings("chat", 128), tokenizer, tmp_path / "o")
    rows = rejected(tmp_path / "o")
    assert [(r["line"], r["kind"]) for r in rows] == [
        (3, "not_unicode"),
        (4, "invalid_json"),
        (5, "invalid_record"),
    ]
    assert "lone surrogate" in rows[0]["reason"] and len(rows[2]["reason"]) < 200
    assert report["rows_out"] == 2
    res = evaluate(path, tiny_llama_dir)
    assert res.code == 0 and json.loads(res.out)["bad_lines"] == 3, res


# --- chat templates that refuse a record, or are missing --------------------------------------


RAISING = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_record_the_template_refuses_is_a_counted_drop(tmp_path: Path, tokenizer) -> None:
    """With data.system_message=keep the template's refusal stands; by default (auto) the
    system message is folded into the user turn and the record trains."""
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = RAISING
    sys_first = {"messages": [{"role": "system", "content": "s"}, *GOOD[0]["messages"]]}
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD[0], sys_first, GOOD[1]])
    keep = PrepareSettings("chat", 128, system_message="keep")
    report = prepare_dataset([str(path)], keep, tok, tmp_path / "o")
    assert report["dropped"] == {"template_error": 1} and report["rows_out"] == 2
    [row] = rejected(tmp_path / "o")
    assert row["line"] == 2 and "System role not supported" in row["reason"]
    data = prepare_rows(
        path, "chat", tok, 128, pack=False, system_message="keep", max_bad_fraction=0.5
    )
    assert [b.line for b in data.bad] == [2] and "System role not supported" in data.bad[0].reason
    folded = prepare_dataset([str(path)], PrepareSettings("chat", 128), tok, tmp_path / "f")
    assert folded["dropped"] == {} and folded["rows_out"] == 3


def test_chat_data_with_a_tokenizer_without_a_template_is_refused(
    tmp_path: Path, tokenizer
) -> None:
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", GOOD)
    with pytest.raises(DataError, match="no chat template"):
        prepare_dataset([str(path)], PrepareSettings("chat", 128), tok, tmp_path / "o")
    with pytest.raises(DataError, match="no chat template"):
        prepare_rows(path, "chat", tok, 128, pack=False)
