"""DeepSpeed ZeRO (dist.strategy=deepspeed): 2-process gloo runs under torchrun on a tiny model.

The same promise as DDP's and FSDP2's (test_distributed.py): 2 processes with micro-batch B
make the same updates as 1 process with micro-batch 2B, here for ZeRO-3 with LoRA and full
fine-tuning; ZeRO-1 and 2 train and agree too; checkpoints are the single-process layout, so
a run continues at another world size; final/ loads in plain transformers. DeepSpeed is a
test dependency (CI installs it), so nothing here skips without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import chat_rows, make_config, write_jsonl
from test_distributed import (
    COMMON,
    ONE,
    TWO,
    _args,
    _assert_loads_in_plain_transformers,
    _assert_same_run,
    _ok,
    _one_process,
    _torchrun,
)

from leantune.config_dist import DEEPSPEED_INSTALL
from leantune.config_parse import ConfigError
from leantune.training import recipe
from leantune.training.checkpoint import list_complete_checkpoints
from leantune.training.metrics import read_metrics


@pytest.fixture(scope="module")
def train_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("zero_data") / "train.jsonl", chat_rows(32))


def _reference(model: Path, data: Path, run_dir: Path, method: str) -> Path:
    """One process, micro-batch 4, no DeepSpeed: the run ZeRO must reproduce."""
    args = (*COMMON, *ONE, f"method.name={method}")
    recipe.train(make_config(model, data, run_dir, *args), log=lambda _: None)
    return run_dir


@pytest.mark.parametrize("method", ["lora", pytest.param("full", marks=pytest.mark.slow)])
def test_zero3_on_two_processes_updates_as_one_with_twice_the_micro_batch(
    tiny_llama_dir: Path, train_file: Path, tmp_path: Path, method: str
) -> None:
    one = _reference(tiny_llama_dir, train_file, tmp_path / "one", method)
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, train_file, run_dir, *TWO, f"method.name={method}")
    _ok(_torchrun(2, [*args, "dist.strategy=deepspeed"], log_dir=tmp_path / "logs"))
    _assert_same_run(one, run_dir)
    out = {p.parent.name: p.read_text() for p in (tmp_path / "logs").glob("*/*/*/stdout.log")}
    assert set(out) == {"0", "1"} and "summary: steps=4" in out["0"]
    ckpts = list_complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002", "step-000004"]
    marker = json.loads((ckpts[-1] / "COMPLETE").read_text())
    assert "layout" not in marker and "model.safetensors" in marker["files"]
    _assert_loads_in_plain_transformers(run_dir / "final", tiny_llama_dir, method)
