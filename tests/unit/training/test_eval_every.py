"""train.eval_every: periodic eval rows that agree with the final evaluation and never change
the training trajectory."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import make_config

from leantune.config import ConfigError
from leantune.monitor.metrics import read_metrics
from leantune.training.recipe import train


def test_eval_every_logs_rows_and_leaves_training_unchanged(
    tiny_llama_dir: Path,
    chat_files: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    common = (
        f"data.eval={chat_files[1]}",
        "train.max_new_tokens=12",
        "method.dropout=0.2",  # dropout draws random numbers: eval must not shift them
        # The merged and unmerged adapter agree to fp32 rounding; under bf16 autocast (what
        # auto picks on an AMX CPU) only to bf16's (2.4e-5 apart here).
        "train.precision=fp32",
    )
    plain = make_config(tiny_llama_dir, chat_files[0], tmp_path / "plain", *common)
    train(plain, log=lambda m: None)
    cfg = make_config(
        tiny_llama_dir,
        chat_files[0],
        tmp_path / "evals",
        *common,
        "train.eval_every=2",
        "train.eval_every_sample=4",
        "train.eval_exact_match=true",
        "train.eval_base=false",
    )
    summary = train(cfg, log=lambda m: None)
    rows = read_metrics(tmp_path / "evals" / "eval.jsonl")
    assert [r["step"] for r in rows] == [2, 4]
    assert all(r["eval_exact_match_examples"] == 4 for r in rows)
    # The step-4 row is the final model: it agrees with the end-of-run evaluation (which runs
    # on the merged adapter, hence the float tolerance).
    assert rows[-1]["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    assert rows[-1]["eval_exact_match"] == summary["eval_exact_match"]
    assert rows[0]["eval_loss"] != rows[1]["eval_loss"]
    losses = [m["loss"] for m in read_metrics(tmp_path / "evals" / "metrics.jsonl")]
    assert losses == [m["loss"] for m in read_metrics(tmp_path / "plain" / "metrics.jsonl")]


def test_eval_every_needs_eval_data(
    tiny_llama_dir: Path,
    chat_files: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"train\.eval_every: needs data\.eval"):
        make_config(tiny_llama_dir, chat_files[0], tmp_path, "train.eval_every=2")
