"""Run `process_chunk` over the input: in this process (local) or on a Dask cluster.

Both engines yield chunk results in input order and keep only a bounded number of chunks in
flight, so memory stays flat however large the input is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.prepare.readers import RawItem, read_items
from leantune.data.prepare.records import ChunkResult, PrepareSettings, process_chunk

# local is the default: on the 2-core dev machine, process start-up and pickling made parallel
# tokenisation of small inputs slower than one process (`datasets.map(num_proc=2)` was 1.6x
# slower); dask is for inputs big enough to amortise a cluster (benchmarks/prepare.py).
ENGINES = ("local", "dask")
# Chunk results already computed by an interrupted run: index -> result, or None to compute.
Done = Callable[[int], ChunkResult | None]


def _none(index: int) -> ChunkResult | None:
    return None


def iter_chunks(files: Iterable[str], chunk_bytes: int) -> Iterator[list[RawItem]]:
    """Group the raw items of `files` (in order) into chunks of about `chunk_bytes`."""
    chunk: list[RawItem] = []
    size = 0
    # Chunks may span files: boundaries depend only on the inputs and `chunk_bytes`, which is
    # what lets a resumed run find its saved chunks by index.
    for path in files:
        for item in read_items(path):
            chunk.append(item)
            size += item.size
            if size >= chunk_bytes:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def run_local(
    files: list[str],
    settings: PrepareSettings,
    tokenizer: PreTrainedTokenizerBase,
    partition_mb: float = 4.0,
    done: Done = _none,
) -> Iterator[ChunkResult]:
    """Process chunks of about `partition_mb` MB one after another in this process."""
    # The chunk is still read when it is reused: iteration must advance past it either way.
    for i, chunk in enumerate(iter_chunks(files, int(partition_mb * (1 << 20)))):
        yield done(i) or process_chunk(chunk, settings, tokenizer)


def run_dask(
    files: list[str],
    settings: PrepareSettings,
    tokenizer: PreTrainedTokenizerBase,
    scheduler: str | None = None,
    workers: int = 2,
    partition_mb: float = 64.0,
    info: dict[str, Any] | None = None,
    done: Done = _none,
) -> Iterator[ChunkResult]:
    """Process partitions of about `partition_mb` MB on Dask workers, results in input order.

    Args:
        scheduler: address of an existing cluster (`tcp://host:8786`); None starts a
            LocalCluster of `workers` single-threaded worker processes for this call.
        info: filled with the scheduler and worker count, for the report.
        done: results of chunks an interrupted run already computed (not sent again).

    Callers that start a LocalCluster must guard their entry point with
    `if __name__ == "__main__":`: worker processes re-import the main module.
    """
    from dask.distributed import Client, LocalCluster

    cluster = None
    if scheduler is None:
        # Single-threaded worker processes: much of the per-record work (validation, template
        # rendering, span search) is Python holding the GIL, so threads would not parallelise it.
        cluster = LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=40,  # logging.ERROR: the cluster's INFO lines would drown the progress
        )
    client = Client(cluster if cluster is not None else scheduler)
    try:
        n_workers = len(client.scheduler_info().get("workers", {})) or workers
        if info is not None:
            info.update(workers=n_workers, scheduler=scheduler or "LocalCluster")
        # The tokenizer travels once to every worker, not once per partition.
        [tok] = client.scatter([tokenizer], broadcast=True)
        window: deque[Any] = deque()
        limit = 2 * n_workers  # chunks in flight: enough to keep workers busy, bounded memory
        for i, chunk in enumerate(iter_chunks(files, int(partition_mb * (1 << 20)))):
            cached = done(i)
            if cached is not None:
                window.append(cached)
            else:
                # pure=False: a random task key, instead of hashing the whole chunk for one.
                window.append(client.submit(process_chunk, chunk, settings, tok, pure=False))
            if len(window) >= limit:
                yield _result(window.popleft())
        while window:
            yield _result(window.popleft())
    # Closed however the generator ends (a consumer that stops early included), so no worker
    # processes outlive the call.
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _result(item: Any) -> ChunkResult:
    return item if isinstance(item, ChunkResult) else item.result()
