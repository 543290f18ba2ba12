"""Golden trajectory: the tiny Llama's first losses and grad norms, pinned (TRL's tests/invariant).

A refactor of the loop, the loss or the data path must not move the arithmetic. This test trains
the session's tiny Llama (tests/conftest.py) for `STEPS` steps in fp32 with a fixed seed, with a
full fine-tune and with LoRA, and compares `loss` and `grad_norm` of each metrics.jsonl record with
tests/golden/tiny_llama_trajectory.json, which also records the seed, the overrides and the
torch/transformers/peft versions (and the CPU kernels torch chose) that made the numbers.

Tolerance: `REL_TOL` = 1e-6 relative. The numbers are bit-identical from run to run on one CPU
(AVX512, 1 or 2 threads). Under AVX2 kernels (`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2`) the losses stay bit-identical and the grad norms move by up to
2.7e-7 relative (fp32 reductions summed in another order); 1e-6 covers that with a margin.

To regenerate after a change that is meant to move the numbers (say why in the commit):

    LEANTUNE_REGEN_GOLDEN=1 python -m pytest tests/integration/test_golden.py

which rewrites the golden file from the current code and environment, then passes.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import peft
import pytest
import torch
import transformers
from support import chat_rows, write_jsonl

from leantune import load_config, train
from leantune.monitor.metrics import read_metrics

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny_llama_trajectory.json"
REGEN_ENV = "LEANTUNE_REGEN_GOLDEN"
SEED = 3
STEPS = 4
REL_TOL = 1e-6
METHODS = {
    "full": ["method.name=full", "train.lr=1e-3"],
    "lora": ["method.name=lora", "train.lr=1e-2"],
}


def _environment() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def _overrides(model_dir: Path, data: Path, run_dir: Path, method: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"data.train={data}",
        "data.format=chat",
        "data.max_seq_len=128",
        "data.eval=null",
        "train.eval_exact_match=false",
        f"run.dir={run_dir}",
        "run.progress=false",
        "train.precision=fp32",
        "train.device=cpu",
        f"train.max_steps={STEPS}",
        "train.micro_batch_size=2",
        f"train.seed={SEED}",
        *METHODS[method],
    ]


def _trajectory(model_dir: Path, tmp_path: Path, method: str) -> list[dict[str, float]]:
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(24))
    run_dir = tmp_path / f"run-{method}"
    cfg = load_config(None, _overrides(model_dir, data, run_dir, method))
    train(cfg, log=None)
    return [
        {"loss": r["loss"], "grad_norm": r["grad_norm"]}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def test_tiny_llama_trajectory_matches_the_golden_file(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    got = {m: _trajectory(tiny_llama_dir, tmp_path, m) for m in METHODS}
    if os.environ.get(REGEN_ENV) == "1":
        record = {
            "about": "tests/integration/test_golden.py: first losses and grad norms of the tiny "
            f"Llama; regenerate with {REGEN_ENV}=1 python -m pytest "
            "tests/integration/test_golden.py",
            "seed": SEED,
            "steps": STEPS,
            "overrides": {m: METHODS[m] for m in METHODS},
            "environment": _environment(),
            "trajectories": got,
        }
        GOLDEN.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert golden["seed"] == SEED and golden["steps"] == STEPS
    assert golden["overrides"] == METHODS
    recorded, now = golden["environment"], _environment()
    hint = f"recorded with {recorded}, running {now}; {REGEN_ENV}=1 regenerates"
    for method, want in golden["trajectories"].items():
        assert len(got[method]) == len(want) == STEPS, (method, hint)
        for step, (g, w) in enumerate(zip(got[method], want, strict=True), start=1):
            for key in ("loss", "grad_norm"):
                assert g[key] == pytest.approx(w[key], rel=REL_TOL, abs=0), (
                    method,
                    step,
                    key,
                    hint,
                )
