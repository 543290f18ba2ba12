"""The Dask engine (LocalCluster, 2 workers) writes exactly what the local engine writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
from support import write_jsonl

from leantune.data.prepare.clean import RULES
from leantune.data.prepare.pipeline import prepare_dataset
from leantune.data.prepare.records import PrepareSettings


def test_local_and_dask_outputs_are_identical(tmp_path: Path, tokenizer) -> None:
    rows: list[object] = []
    for i in range(120):
        # 40..99 repeat 0..39 exactly; 100..119 add "!" (near duplicates of 20..39)
        answer = f"<p>Order&nbsp;{i % 40} is  on its way, ｅｔａ {i % 40 % 7} days.</p>"
        answer += "!" if i >= 100 else ""
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"where is {i % 40}?"},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
        if i % 25 == 0:
            rows += ["{broken", "[1]", ""]
    files = [
        write_jsonl(tmp_path / "a.jsonl", rows[:70]),
        write_jsonl(tmp_path / "b.jsonl", rows[70:]),
    ]
    settings = PrepareSettings(format="chat", max_seq_len=96, clean=RULES, dedup="near")
    names = [str(f) for f in files]
    local = prepare_dataset(names, settings, tokenizer, tmp_path / "local")
    t0 = time.perf_counter()
    # ~1 KB partitions: many partitions over 2 workers, so order and partitioning are exercised.
    dask = prepare_dataset(
        names, settings, tokenizer, tmp_path / "dask", engine="dask", workers=2, partition_mb=0.001
    )
    assert time.perf_counter() - t0 < 60
    assert dask["engine"]["workers"] == 2
    assert local["rows_out"] == 40
    assert local["dropped"]["exact_duplicate"] == 60 and local["dropped"]["near_duplicate"] == 20
    for key in ("rows_in", "rows_out", "packed_rows", "dropped", "cleaned", "tokens", "cache_key"):
        assert dask[key] == local[key], key
    local_files = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert local_files == sorted(p.name for p in (tmp_path / "dask").iterdir())
    for name in local_files:
        a, b = tmp_path / "local" / name, tmp_path / "dask" / name
        if name.endswith(".parquet"):
            assert pq.read_table(a).equals(pq.read_table(b)), name
        elif name == "rejected.jsonl":
            assert a.read_text() == b.read_text()
    # --scheduler ADDRESS: an existing cluster gives the same output (and is left running)
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None) as cluster:
        remote = prepare_dataset(
            names,
            settings,
            tokenizer,
            tmp_path / "remote",
            engine="dask",
            scheduler=cluster.scheduler_address,
            partition_mb=0.002,
        )
        assert remote["engine"]["scheduler"] == cluster.scheduler_address
        assert len(cluster.workers) == 1
    for name in local_files:
        if name.endswith(".parquet"):
            a = pq.read_table(tmp_path / "local" / name)
            assert a.equals(pq.read_table(tmp_path / "remote" / name)), name
    rejected = [
        json.loads(x) for x in (tmp_path / "dask" / "rejected.jsonl").read_text().splitlines()
    ]
    assert {r["kind"] for r in rejected} >= {"invalid_json", "not_object", "exact_duplicate"}
