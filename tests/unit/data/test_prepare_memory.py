"""Streaming: peak memory of `prepare` does not grow with the input size.

Each size runs in a fresh process (ru_maxrss is per process) through benchmarks/prepare.py's
single-engine mode, on a generated noisy corpus with exact dedup on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from leantune.data.prepare.clean import RULES
from leantune.data.prepare.pipeline import prepare_dataset
from leantune.data.prepare.records import PrepareSettings

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks" / "prepare.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("prepare_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peak_rss_mb(corpus: Path, out: Path, model: Path, partition_mb: float, shard_tokens: int):
    """Run the local engine on `corpus` in a new process; returns its result line."""
    cmd = [
        sys.executable,
        str(BENCH),
        "--run-one",
        "local",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--model",
        str(model),
        "--max-seq-len",
        "1024",
        "--dedup",
        "exact",
        "--partition-mb",
        str(partition_mb),
        "--shard-tokens",
        str(shard_tokens),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _growth(tmp_path: Path, model: Path, small_mb: float, big_mb: float, **kw) -> tuple:
    bench = _bench_module()
    results = []
    for mb in (small_mb, big_mb):
        corpus = tmp_path / f"c{mb:g}.jsonl"
        bench.generate_corpus(corpus, mb)
        results.append(peak_rss_mb(corpus, tmp_path / f"o{mb:g}", model, **kw))
        corpus.unlink()
    return results[0], results[1]


def test_traced_peak_memory_does_not_grow_with_the_input(tmp_path: Path, tokenizer) -> None:
    """In process, with tracemalloc (exact, no RSS noise): 5x the input, same peak."""
    bench = _bench_module()
    settings = PrepareSettings(format="chat", max_seq_len=1024, clean=RULES, dedup="exact")
    peaks, kept = [], []
    for run, mb in enumerate((0.1, 0.1, 0.5)):
        corpus = tmp_path / f"c{mb:g}.jsonl"
        bench.generate_corpus(corpus, mb)
        if run == 0:  # warm-up: first-use imports and caches would count as growth
            prepare_dataset([str(corpus)], settings, tokenizer, tmp_path / "warm")
            continue
        tracemalloc.start()
        report = prepare_dataset(
            [str(corpus)],
            settings,
            tokenizer,
            tmp_path / f"o{run}",
            partition_mb=0.02,
            shard_tokens=10_000,
        )
        peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
        tracemalloc.stop()
        kept.append(report["rows_out"])
    assert kept[1] > 4 * kept[0]
    # Holding the 0.5 MB corpus (records + token ids) would add over 2 MB; streaming adds
    # only the dedup index (~100 bytes per record).
    assert peaks[1] - peaks[0] < 0.5, peaks


@pytest.mark.slow
def test_memory_stays_flat_on_1gb(tmp_path: Path, tokenizer_dir: Path) -> None:
    """LEANTUNE_PREPARE_RSS_MB sets the size (default 1024 MB; compared with 1/8 of it)."""
    size = float(os.environ.get("LEANTUNE_PREPARE_RSS_MB", "1024"))
    # Small partitions and shards reach the memory plateau early, so that even a modest check
    # run (LEANTUNE_PREPARE_RSS_MB=16) compares two sizes on it; the defaults (4 MB partitions,
    # 2M-token shards) only raise the plateau.
    small, big = _growth(
        tmp_path, tokenizer_dir, size / 8, size, partition_mb=0.5, shard_tokens=250_000
    )
    print(
        f"peak RSS: {size / 8:g} MB -> {small['self_peak_rss_mb']:.0f} MB, "
        f"{size:g} MB -> {big['self_peak_rss_mb']:.0f} MB"
    )  # shown with pytest -s
    assert big["rows_out"] > 7 * small["rows_out"]
    # The exact-dedup index keeps ~100 bytes per unique record (~70 MB per GB of this corpus);
    # everything else is bounded by the partition and shard sizes.
    assert big["self_peak_rss_mb"] - small["self_peak_rss_mb"] < 150, (small, big)
