"""The distributed tests' fixtures: their training data and the one-process runs (one per
method) that the 2-process DDP, FSDP2 and ZeRO runs must reproduce. Helpers: dist_support.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_support import _train_here
from support import chat_rows, write_jsonl


@pytest.fixture(scope="module")
def dist_train_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The distributed tests' training data (32 chat rows), one file per test module."""
    data = tmp_path_factory.mktemp("dist_data") / "train.jsonl"
    return write_jsonl(data, chat_rows(32))


@pytest.fixture(scope="module")
def dist_reference(
    tiny_llama_dir: Path, dist_train_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """One process without any strategy, micro-batch 4, per method: the run that 2-process
    DDP, FSDP2 and ZeRO runs must reproduce."""
    runs = {}
    for method in ("lora", "full"):
        run_dir = tmp_path_factory.mktemp(f"one_{method}") / "run"
        _train_here(tiny_llama_dir, dist_train_file, run_dir, f"method.name={method}")
        runs[method] = run_dir
    return runs
