"""Fuzzing the data path: every reader and every format.

Arbitrary bytes under each suffix, arbitrary JSON values, record-shaped values with wrong
types, lone surrogates and deep nesting, and valid files cut short or with bytes flipped. Each
must end as a refusal of the whole file (a `DataError` that names it) or as records that are
kept or dropped with a known kind and the file and line they came from; never another
exception. Per record, time and memory stay bounded: the tokenizer is never handed a text
that is certainly longer than data.max_seq_len. Examples are few per test (the suite takes
well under a minute) and there are no timing assertions.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from support import prepare_rows

from leantune.data.bounds import token_floor
from leantune.data.dataset import DataError
from leantune.data.formats import detect_format
from leantune.data.prepare.clean import RULES
from leantune.data.prepare.pipeline import prepare_dataset
from leantune.data.prepare.readers import read_items
from leantune.data.prepare.records import PrepareSettings, process_chunk

KINDS = ("jsonl", "jsonl.gz", "jsonl.zst", "json", "parquet", "csv")
FORMATS = ("alpaca", "chat", "text", "sharegpt", "prompt_completion")
DROP_KINDS = {
    "invalid_json",
    "not_utf8",
    "empty_line",
    "too_deep",
    "bad_csv_row",
    "not_object",
    "missing_field",
    "empty_field",
    "not_unicode",
    "invalid_record",
    "empty_after_cleaning",
    "too_long",
    "too_short",
    "no_supervised",
    "answer_truncated",
    "template_error",
    "unsupported",
}
MAX_SEQ_LEN = 64
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same examples every run: a failure reproduces
    database=None,
)

# --- strategies -------------------------------------------------------------------------------

TEXT = st.text(max_size=40) | st.sampled_from(
    [
        "",
        "  ",
        "a\ud800b",  # a lone surrogate
        "<![a <script>x</script> &#99999999999; &copy",
        "<|im_start|>assistant\n",
        "{{ messages }}{% endfor %}",
        "\x00\x06\u200b\ufeff",
        "word " * 300,  # longer than MAX_SEQ_LEN tokens
    ]
)
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
ROLE = st.sampled_from(["system", "user", "assistant", "robot", ""]) | JSON
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": TEXT | JSON}) | JSON
TURN = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}
)
ANSWER = st.fixed_dictionaries({"role": st.just("assistant"), "content": TEXT})
CHAT = st.tuples(st.lists(TURN, max_size=4), ANSWER).map(lambda t: {"messages": [*t[0], t[1]]})
FROM = st.sampled_from(["human", "gpt", "system", "user", "function_call", "robot"]) | JSON
SHARE_TURN = st.fixed_dictionaries({"from": FROM, "value": TEXT | JSON}) | MESSAGE
SHAREGPT = st.fixed_dictionaries(
    {"conversations": st.lists(SHARE_TURN, max_size=5) | TEXT | JSON},
    optional={"system": TEXT | JSON, "tools": TEXT | JSON, "images": JSON},
)
GOOD_SHAREGPT = st.tuples(
    st.lists(
        st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system"]), "value": TEXT}),
        max_size=4,
    ),
    TEXT,
).map(lambda t: {"conversations": [*t[0], {"from": "gpt", "value": t[1]}]})
SIDE = TEXT | st.lists(MESSAGE, max_size=3) | st.lists(TURN, min_size=1, max_size=3) | JSON
PROMPT_COMPLETION = st.fixed_dictionaries(
    {"prompt": SIDE, "completion": SIDE | st.lists(ANSWER, min_size=1, max_size=2)},
    optional={"label": JSON, "chosen": TEXT},
)
RECORD = st.one_of(
    CHAT,
    GOOD_SHAREGPT,
    SHAREGPT,
    PROMPT_COMPLETION,
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=5) | JSON}),
    st.fixed_dictionaries(
        {"instruction": TEXT | JSON, "output": TEXT | JSON},
        optional={"input": TEXT | JSON},
    ),
    st.fixed_dictionaries({"text": TEXT | JSON}),
    JSON,
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


class Unwritable(Exception):
    """Values that no file of this kind can hold (arrow refuses them): nothing to read."""


def _jsonl(values: list[Any], extra: list[bytes]) -> bytes:
    lines = [json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass") for v in values]
    return b"\n".join([*lines, *extra]) + b"\n"


def _csv(values: list[Any]) -> bytes:
    rows = [v for v in values if isinstance(v, dict)]
    header = sorted({k for r in rows for k in r if isinstance(k, str) and k})
    if not header:
        raise Unwritable("no string keys for a header")
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(header)
    for r in rows:
        cells = [r.get(k) for k in header]
        w.writerow([c if isinstance(c, str) else json.dumps(c) for c in cells])
    return out.getvalue().encode("utf-8", "surrogatepass")


def _parquet(values: list[Any]) -> bytes:
    rows = [v for v in values if isinstance(v, dict)]
    buf = io.BytesIO()
    try:
        pq.write_table(pa.Table.from_pylist(rows), buf)
    except (pa.ArrowException, TypeError, ValueError, UnicodeEncodeError) as e:
        raise Unwritable(str(e)) from e
    return buf.getvalue()


def encode_file(kind: str, values: list[Any], extra: list[bytes]) -> bytes:
    """A file of `kind` holding `values` (and, for JSONL kinds, the raw `extra` lines).

    Raises:
        Unwritable: a CSV without a string key, or values arrow cannot hold.
    """
    if kind == "json":
        return json.dumps(values, ensure_ascii=False).encode("utf-8", "surrogatepass")
    if kind == "csv":
        return _csv(values)
    if kind == "parquet":
        return _parquet(values)
    body = _jsonl(values, extra)
    if kind == "jsonl.gz":
        return gzip.compress(body)
    if kind == "jsonl.zst":
        return zstandard.ZstdCompressor().compress(body)
    return body


RAW_LINES = st.lists(
    st.binary(max_size=60) | st.sampled_from([b"\xef\xbb\xbf{}", _deep(5000).encode()]),
    max_size=3,
)

# --- the property -----------------------------------------------------------------------------


def _guard_tokenizer(monkeypatch: pytest.MonkeyPatch, tok: Any) -> None:
    """Fail if the tokenizer is ever given a text certainly longer than MAX_SEQ_LEN tokens."""
    floor = token_floor(tok)
    assert floor is not None
    real = type(tok).__call__

    def guarded(self: Any, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        for t in text if isinstance(text, list) else [text]:
            if isinstance(t, str):
                assert floor.exceeds(t, MAX_SEQ_LEN) is None, f"tokenised {len(t)} characters"
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tok), "__call__", guarded)


def check_file(path: Path, fmt: str, tok: Any, clean: bool = False) -> None:
    """Both data paths give a refusal naming `path`, or consistent, located counts."""
    s = PrepareSettings(fmt, MAX_SEQ_LEN, clean=RULES if clean else ())
    try:
        items = list(read_items(path))
    except DataError as e:
        assert str(path) in str(e)
        with pytest.raises(DataError):
            prepare_rows(path, fmt, tok, MAX_SEQ_LEN, pack=False, max_bad_fraction=1.0)
        return
    result = process_chunk(items, s, tok)
    assert len(result.kept) + len(result.rejected) == len(result.order) == len(items)
    for r in result.rejected:
        assert r.kind in DROP_KINDS and r.source == str(path) and r.line >= 1, r
    for k in result.kept:
        assert k.input_ids.size <= MAX_SEQ_LEN and (k.labels != -100).any()
    try:
        data = prepare_rows(path, fmt, tok, MAX_SEQ_LEN, pack=False, max_bad_fraction=1.0)
    except DataError as e:  # nothing usable: the same verdict as above, unless cleaning differs
        assert str(path) in str(e) and (clean or not result.kept)
        return
    assert data.total_lines == len(data.examples) + len(data.bad)
    assert all(b.file == str(path) and b.line >= 1 for b in data.bad)
    if not clean:  # the same records pass both paths (prepare_rows does not clean)
        assert len(data.examples) == len(result.kept)
    assert detect_format(path) in FORMATS


def _in_temp(kind: str, blob: bytes, fn: Callable[[Path], None]) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"fuzz.{kind}"
        path.write_bytes(blob)
        fn(path)


# --- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_arbitrary_bytes_under_each_suffix(kind: str, tokenizer, monkeypatch) -> None:
    _guard_tokenizer(monkeypatch, tokenizer)

    @FUZZ
    @given(blob=st.binary(max_size=400), fmt=st.sampled_from(FORMATS))
    def run(blob: bytes, fmt: str) -> None:
        _in_temp(kind, blob, lambda p: check_file(p, fmt, tokenizer))

    run()


# Every reader and every format in the default suite (one diagonal: each reader with one format
# in turn, 6 cases); the full 30-case cross product (54 s here) behind slow.
READER_FORMAT_CASES = [
    pytest.param(kind, fmt, marks=() if j == i % len(FORMATS) else pytest.mark.slow)
    for i, kind in enumerate(KINDS)
    for j, fmt in enumerate(FORMATS)
]


@pytest.mark.parametrize(("kind", "fmt"), READER_FORMAT_CASES)
def test_arbitrary_records_in_each_reader_and_format(
    kind: str, fmt: str, tokenizer, monkeypatch
) -> None:
    _guard_tokenizer(monkeypatch, tokenizer)

    @FUZZ
    @given(values=st.lists(RECORD, max_size=5), extra=RAW_LINES, clean=st.booleans())
    def run(values: list[Any], extra: list[bytes], clean: bool) -> None:
        try:
            blob = encode_file(kind, values, extra)
        except Unwritable:
            reject()
        _in_temp(kind, blob, lambda p: check_file(p, fmt, tokenizer, clean))

    run()


@pytest.mark.parametrize("kind", KINDS)
def test_valid_files_cut_short_or_with_bytes_flipped(kind: str, tokenizer, monkeypatch) -> None:
    _guard_tokenizer(monkeypatch, tokenizer)
    rows = [
        {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(40)
    ]
    good = encode_file(kind, rows, [])

    @FUZZ
    @given(cut=st.integers(0, len(good)), flips=st.lists(st.integers(0, len(good) - 1), max_size=3))
    def run(cut: int, flips: list[int]) -> None:
        blob = bytearray(good)
        for i in flips:
            blob[i] ^= 0x5A
        _in_temp(
            kind,
            bytes(blob[:cut] if cut < len(good) else blob),
            lambda p: check_file(p, "chat", tokenizer),
        )

    run()


def test_the_full_pipeline_writes_what_it_counted(tmp_path: Path, tokenizer) -> None:
    """prepare_dataset end to end: the report, rejected.jsonl and the shards agree."""
    counter = iter(range(10**6))

    @settings(FUZZ, max_examples=10)
    @given(
        kind=st.sampled_from(KINDS),
        fmt=st.sampled_from(FORMATS),
        values=st.lists(RECORD, min_size=1, max_size=6),
    )
    def run(kind: str, fmt: str, values: list[Any]) -> None:
        path = tmp_path / f"d{next(counter)}.{kind}"
        try:
            path.write_bytes(encode_file(kind, values, []))
        except Unwritable:
            reject()
        out = tmp_path / f"{path.name}.out"
        s = PrepareSettings(fmt, MAX_SEQ_LEN, clean=RULES, dedup="near")
        try:
            report = prepare_dataset([str(path)], s, tokenizer, out)
        except DataError as e:
            assert str(path) in str(e) and not out.exists()
            return
        rows = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
        assert report["rows_in"] == report["rows_out"] + len(rows)
        assert sum(report["dropped"].values()) == len(rows)

    run()


def test_deep_nesting_at_every_level_of_a_record(tmp_path: Path, tokenizer) -> None:
    deep = json.loads(_deep(900))  # as deep as json parses here, then wrapped in a record
    values = [
        {"messages": deep},
        {"messages": [{"role": "user", "content": deep}]},
        {"text": deep},
        {"instruction": "q", "output": deep},
    ]
    for kind in KINDS:
        for fmt in FORMATS:
            path = tmp_path / f"deep.{kind}"
            try:
                path.write_bytes(encode_file(kind, values, [_deep(100_000).encode()]))
            except (Unwritable, RecursionError):  # no such file can be written: nothing to read
                continue
            check_file(path, fmt, tokenizer)
