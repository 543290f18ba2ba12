"""`prepare_dataset`: input files -> a prepared directory that `train` reads directly.

Stream chunks through an engine (validate, clean, hash, tokenise), dedup on the driver in input
order, write Parquet shards with packed rows, `rejected.jsonl` and `prepare_report.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.core.digests import content_digest
from leantune.core.writes import check_target, replacing_dir, write_file
from leantune.data.errors import DataError
from leantune.data.prepare.chunks import ChunkStore
from leantune.data.prepare.dedup import DedupIndex
from leantune.data.prepare.engines import ENGINES, run_dask, run_local
from leantune.data.prepare.provenance import DIGEST_KEY, tokenizer_digest, tokenizer_fingerprint
from leantune.data.prepare.readers import ReaderError, file_kind
from leantune.data.prepare.records import ChunkResult, Kept, PrepareSettings, Rejection
from leantune.data.prepare.shards import SHARD_TOKENS, ShardBuffer, write_shard
from leantune.data.tokenize import IGNORE_INDEX
from leantune.errors import UserError
from leantune.layout import PreparedPaths

# Part of the cache key: bump it whenever the same inputs and settings would give other output,
# so that directories prepared by an older leantune are prepared again instead of reused.
PIPELINE_VERSION = 5

Log = Callable[[str], None]


class OutputExistsError(FileExistsError, UserError):
    """The output directory holds something that is not a prepared directory."""


def cache_key(
    files: list[str], settings: PrepareSettings, tokenizer: PreTrainedTokenizerBase
) -> str:
    """The key of a prepared directory: input contents, tokenizer, template and settings."""
    # content_digest, as in a run's fingerprint: one definition of "the same data" for
    # `prepare`, the tokenise-once cache and resume. sort_keys makes the JSON canonical.
    parts = {
        "version": PIPELINE_VERSION,
        "files": [content_digest(f) for f in files],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": settings.as_dict(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def read_report(out: str | Path) -> dict[str, Any] | None:
    """The report of a complete prepared directory, or None."""
    # The report is written last, inside the directory swapped in whole: its presence is what
    # marks a directory complete.
    path = PreparedPaths(Path(out)).report
    if not path.is_file():
        return None
    report: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return report


class _Writer:
    """Driver side: dedup in input order, buffer shards, write rejected rows."""

    def __init__(self, out: Path, settings: PrepareSettings, shard_tokens: int) -> None:
        self.out = out
        self.shard_tokens = shard_tokens
        self.settings = settings
        self.dedup = DedupIndex(settings.dedup, settings.near_dup_threshold, settings.num_perm)
        self.rejected = PreparedPaths(out).rejected.open("w", encoding="utf-8")
        self.column = "text" if settings.format == "text" else "messages"
        self.buf = ShardBuffer()
        self.shards: list[dict[str, Any]] = []
        self.dropped: Counter[str] = Counter()
        self.cleaned: Counter[str] = Counter()
        self.rows_in = 0
        self.supervised = 0
        # Where each kept record came from, to name the original of a duplicate. Compact
        # arrays, and each source name stored once per run of records, since millions of
        # records are kept on the driver.
        self.kept_sources: list[str] = []
        self.kept_src = array("i")
        self.kept_line = array("q")
        self.dedup_s = 0.0
        self.write_s = 0.0
        self.worker_s = 0.0

    def reject(self, r: Rejection, extra: dict[str, Any] | None = None) -> None:
        self.dropped[r.kind] += 1
        row = r.row() | (extra or {})
        self.rejected.write(json.dumps(row, ensure_ascii=False) + "\n")

    def add_chunk(self, result: ChunkResult) -> None:
        self.rows_in += len(result.order)
        self.cleaned.update(result.cleaned)
        self.worker_s += result.seconds
        # Replayed in input order, so dedup keeps the first occurrence whatever engine ran it.
        kept, rejected = iter(result.kept), iter(result.rejected)
        for is_kept in result.order:
            if is_kept:
                self._keep(next(kept))
            else:
                self.reject(next(rejected))

    def _keep(self, k: Kept) -> None:
        t0 = time.perf_counter()
        rid = len(self.kept_line)
        verdict = self.dedup.check(rid, k.digest, k.signature)
        self.dedup_s += time.perf_counter() - t0
        if verdict is not None:
            of = f"{self.kept_sources[self.kept_src[verdict.of]]}:{self.kept_line[verdict.of]}"
            reason = f"{verdict.kind.replace('_', ' ')} of {of}"
            if verdict.kind == "near_duplicate":
                reason += f" (estimated Jaccard {verdict.similarity:.2f})"
            self.reject(Rejection(k.source, k.line, verdict.kind, reason), {"duplicate_of": of})
            return
        # Records arrive file by file, so a new source is always the last one seen.
        if not self.kept_sources or self.kept_sources[-1] != k.source:
            self.kept_sources.append(k.source)
        self.kept_src.append(len(self.kept_sources) - 1)
        self.kept_line.append(k.line)
        b = self.buf
        b.sources.append(k.source)
        b.lines.append(k.line)
        b.records.append(k.record)
        b.ids.append(k.input_ids)
        b.labels.append(k.labels)
        b.tokens += int(k.input_ids.size)
        self.supervised += int((k.labels != IGNORE_INDEX).sum())
        if b.tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.buf.ids:
            return
        t0 = time.perf_counter()
        s = self.settings
        # The index of the shard's first example in the whole dataset, so rows can name examples.
        first = sum(int(sh["examples"]) for sh in self.shards)
        self.shards.append(
            write_shard(
                self.out, len(self.shards), self.buf, self.column, s.max_seq_len, s.pack, first
            )
        )
        self.buf = ShardBuffer()
        self.write_s += time.perf_counter() - t0

    def close(self) -> None:
        self.flush()
        self.rejected.close()


def _engine_results(
    engine: str,
    files: list[str],
    settings: PrepareSettings,
    tokenizer: PreTrainedTokenizerBase,
    dask_options: dict[str, Any],
    info: dict[str, Any],
    partial: ChunkStore,
    partition_mb: float,
) -> Iterator[ChunkResult]:
    if engine == "local":
        results = run_local(files, settings, tokenizer, partition_mb, done=partial.load)
    else:
        options = {**dask_options, "partition_mb": partition_mb}
        results = run_dask(files, settings, tokenizer, info=info, done=partial.load, **options)
    # Each chunk is saved before the writer sees it: a run killed half-way resumes from its
    # finished chunks (`done=partial.load` skips them).
    for i, result in enumerate(results):
        partial.save(i, result)
        yield result


def _remove_stale_tmp(out: Path) -> None:
    """Delete half-built directories left by killed preparations (their process is gone)."""
    for tmp in out.parent.glob(f"{out.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        # Signal 0 checks that the process exists without touching it: a live one is still
        # preparing into its directory.
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _check_out(out: Path) -> None:
    """Refuse an `out` that holds something else than a prepared directory, before any work."""
    check_target(out, folder=True)
    if out.is_dir() and any(out.iterdir()) and read_report(out) is None:
        raise OutputExistsError(
            f"{out}: exists and is not a prepared directory (no {PreparedPaths.report}); "
            "choose another --out or remove it"
        )


def prepare_dataset(
    files: list[str],
    settings: PrepareSettings,
    tokenizer: PreTrainedTokenizerBase,
    out: str | Path,
    engine: str = "local",
    scheduler: str | None = None,
    workers: int = 2,
    partition_mb: float | None = None,
    force: bool = False,
    log: Log | None = None,
    shard_tokens: int = SHARD_TOKENS,
) -> dict[str, Any]:
    """Prepare `files` into the directory `out`; returns the report (also in prepare_report.json).

    A complete `out` with the same cache key is reused as is (`cache_hit: true`). Partitions
    are `partition_mb` MB of input (default 4 locally, 64 on Dask); a shard holds about
    `shard_tokens` tokens (packing is per shard: keep the default).

    Raises:
        ValueError: unknown engine. FileNotFoundError: a missing input.
        DataError: an input that cannot be read as its kind (a directory, an unsupported
            suffix, a damaged archive, ...): nothing is written.
        FileExistsError: `out` holds something else.
        OutputError: `out` is a link, or the disk refused a write; an earlier `out` is kept
            whole (`leantune.core.writes.replacing_dir`).
    """
    # Inputs are checked before anything is written or any cache is touched.
    _check_inputs(files, engine)
    started = time.perf_counter()
    out = Path(out)
    key = cache_key(files, settings, tokenizer)
    previous = read_report(out)
    if previous is not None and previous.get("cache_key") == key and not force:
        previous["cache_hit"] = True  # rewritten so the report says this run reused it
        write_file(PreparedPaths(out).report, json.dumps(previous, indent=2))
        if log:
            log(f"prepare: cache hit, {out} is up to date (key {key[:12]})")
        return previous
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out)
    info: dict[str, Any] = {}
    dask_options = {"scheduler": scheduler, "workers": workers}
    # Small partitions locally (steady progress, little memory per worker); large ones on Dask,
    # where each task has a scheduling overhead.
    mb = partition_mb or (4.0 if engine == "local" else 64.0)
    # Built under a temporary name and swapped in whole: a failure (a full disk included)
    # leaves an earlier `out` as it was; the finished chunks stay for the next attempt.
    with replacing_dir(out, out.with_name(f"{out.name}.tmp-{os.getpid()}")) as tmp:
        partial = ChunkStore(out, key, mb)
        writer = _Writer(tmp, settings, shard_tokens)
        try:
            for result in _engine_results(
                engine, files, settings, tokenizer, dask_options, info, partial, mb
            ):
                writer.add_chunk(result)
            writer.close()
        # BaseException: a Ctrl-C must close the file too; the chunks already saved are kept for
        # the next attempt.
        except BaseException as e:
            writer.rejected.close()
            if isinstance(e, DataError):  # an input refused whole: its chunks are of no use
                partial.remove()
            raise
        info["chunks_reused"] = partial.reused
        info["resume_data_bytes"] = partial.disk_bytes()  # its peak: gone once `out` is whole
        report = _report(writer, files, settings, tokenizer, key, engine, info, started)
        write_file(PreparedPaths(tmp).report, json.dumps(report, indent=2))
    partial.remove()  # only once `out` is whole: until then the chunks are the way to resume
    if log:
        log(_summary_line(report, settings.pack, out))
    return report


def _check_inputs(files: list[str], engine: str) -> None:
    """Every input is a readable data file of a known kind, before anything is written."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {' | '.join(ENGINES)}")
    for f in files:
        if Path(f).is_dir():
            raise ReaderError(f"{f}: is a directory, not a data file")
        if not Path(f).is_file():
            raise FileNotFoundError(f"{f}: no such data file")
        file_kind(f)  # raises for an unknown suffix, before any work is done


def _summary_line(d: dict[str, Any], pack: bool, out: Path) -> str:
    rows = (
        f"{d['packed_rows']} rows (packing {d['packing_efficiency']:.1%})"
        if pack
        else "one example per row"
    )
    return (
        f"prepare: {d['rows_in']} records in, {d['rows_out']} kept, {rows}, dropped "
        f"{d['dropped']} -> {out}"
    )


def _report(
    w: _Writer,
    files: list[str],
    settings: PrepareSettings,
    tokenizer: PreTrainedTokenizerBase,
    key: str,
    engine: str,
    info: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    examples = sum(s["examples"] for s in w.shards)
    rows = sum(s["rows"] for s in w.shards)
    tokens = sum(s["tokens"] for s in w.shards)
    total = time.perf_counter() - started
    return {
        "rows_in": w.rows_in,
        "rows_out": examples,
        "packed_rows": rows,
        "dropped": dict(sorted(w.dropped.items())),
        "cleaned": dict(sorted(w.cleaned.items())),
        "tokens": tokens,
        "supervised_tokens": w.supervised,
        "packing_efficiency": tokens / max(1, rows * settings.max_seq_len),
        "shards": w.shards,
        "timings": {
            "total_s": round(total, 3),
            "process_s_sum_over_workers": round(w.worker_s, 3),
            "dedup_s": round(w.dedup_s, 3),
            "write_and_pack_s": round(w.write_s, 3),
            "rows_per_s": round(w.rows_in / max(total, 1e-9), 1),
        },
        "engine": {"name": engine, **info},
        "files": [str(Path(f).resolve()) for f in files],
        "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
        DIGEST_KEY: asdict(tokenizer_digest(tokenizer)),
        "settings": settings.as_dict(),
        "cache_key": key,
        "cache_hit": False,
        "version": PIPELINE_VERSION,
    }
