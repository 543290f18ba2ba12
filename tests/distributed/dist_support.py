"""The distributed tests' helpers: `leantune train` in 2 gloo processes under torchrun on the
session's tiny Llama, the one-process runs they must reproduce, and the checks that compare them
(test_distributed*.py). Test files here import them with `from dist_support import ...`; the
fixtures built on them are in this folder's conftest.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import _env, _final_weights, chat_rows, make_config, write_jsonl

from leantune.config.parse import ConfigError
from leantune.training import recipe
from leantune.training.checks import load_config

ONE = ("train.micro_batch_size=4", "train.grad_accum=2")
"""One process: micro-batch 4, two micro-batches per step (global batch 8)."""
TWO = ("train.micro_batch_size=2", "train.grad_accum=4")
"""Two processes: micro-batch 2; the window of 8 gives each rank 4 rows, 2 micro-batches."""
COMMON = ("data.pack=false", "train.precision=fp32", "method.dropout=0", "train.save_every=2")


def _args(model: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """`leantune train` overrides equal to `make_config`'s, then `extra`."""
    return [
        f"model.path={model}",
        f"data.train={data}",
        "data.format=chat",
        "data.max_seq_len=128",
        f"run.dir={run_dir}",
        "run.progress=false",
        "train.max_steps=4",
        "train.lr=1e-2",
        "train.seed=3",
        "data.eval=null",
        "train.eval_exact_match=false",
        *COMMON,
        *extra,
    ]


def _torchrun(
    nproc: int,
    args: list[str],
    *,
    log_dir: Path | None = None,
    cwd: Path | None = None,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """`leantune train ARGS` in `nproc` processes under torchrun (each rank's output in its own
    file under `log_dir` when given), with `env` added to the environment."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}"]
    command += [f"--log-dir={log_dir}", "--redirects=3"] if log_dir else []
    command += ["-m", "leantune", "train", *args]
    return subprocess.run(
        command, env=_env(**env), capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _train_here(model: Path, data: Path, run_dir: Path, *extra: str) -> None:
    """One process without any strategy, in this process: micro-batch 4 (`ONE`), `COMMON`,
    then `extra`; the run a 2-process run with `TWO` must reproduce."""
    cfg = make_config(model, data, run_dir, *COMMON, *ONE, *extra)
    recipe.train(cfg, log=lambda _: None)


def _rank_stdout(log_dir: Path) -> dict[str, str]:
    """What each rank printed, by rank, from torchrun's --log-dir."""
    return {p.parent.name: p.read_text() for p in log_dir.glob("*/*/*/stdout.log")}


def _refused(overrides: list[str], message: str, tmp_path: Path) -> None:
    """The overrides (`{eval}` stands for an eval file) fail validation with `message`."""
    eval_file = write_jsonl(tmp_path / "eval.jsonl", chat_rows(2))
    with pytest.raises(ConfigError, match=message):
        load_config(None, [o.format(eval=eval_file) for o in overrides])


def _assert_loads_in_plain_transformers(final: Path, base_dir: Path, method: str) -> None:
    """final/ is a consolidated HF directory (full) or PEFT adapter (lora) holding the weights
    the run wrote."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = _final_weights(final.parent)
    if method == "full":
        state = AutoModelForCausalLM.from_pretrained(final).state_dict()
        assert all(torch.equal(state[k], saved[k]) for k in saved)
        return
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), final)
    lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(lora) == len(saved)
    moved = [k for k in lora if "lora_B" in k]
    assert moved and all(lora[k].abs().sum() > 0 for k in moved)  # B starts at zero
