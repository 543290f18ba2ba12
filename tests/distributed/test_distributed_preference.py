"""Preference objectives under torchrun: 2-process gloo runs on a tiny model (issue 34).

The promise of test_distributed.py, for train.objective=dpo: 2 processes with micro-batch 2
make the same updates, and log the same reward metrics, as 1 process with micro-batch 4 over
the same global batch of 8 pairs, with DDP and FSDP2 (and, slow, DeepSpeed ZeRO-3). LoRA's
reference is the model with its adapters off, a forward through the data-parallel wrapper on
each rank; full fine-tuning's is computed once before training, every sequence on every rank
(FSDP2's and ZeRO-3's forwards are collective). Default-suite cost: two torchrun runs and their
one-process references, about 60 s (the other pairings and simpo, orpo, kto are slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_support import COMMON, ONE, TWO, _args, _torchrun
from safetensors.torch import load_file
from support import _assert_same_run, _ok, chat_rows, make_config, write_jsonl

from leantune.monitor.metrics import read_metrics
from leantune.training import recipe

PAIRS = [
    {
        "prompt": f"What is {i} plus {i}?",
        "chosen": f"It is {2 * i}.",
        "rejected": f"Maybe {i}" + ", or more" * (i % 3) + ".",  # lengths differ: padding
    }
    for i in range(16)
]
UNPAIRED = [
    {"prompt": p["prompt"], "completion": p[answer], "label": answer == "chosen"}
    for p in PAIRS
    for answer in ("chosen", "rejected")
]
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def _one_and_two(
    model: Path, data: Path, tmp_path: Path, strategy: str, one: tuple[str, ...], *extra: str
) -> tuple[Path, Path]:
    """The one-process run (micro-batch settings `one`) and the 2-process one (micro-batch 2
    per rank) with `extra`; returns their run directories."""
    a, b = tmp_path / "one", tmp_path / "two"
    recipe.train(make_config(model, data, a, *COMMON, *one, *extra), log=lambda _: None)
    done = _torchrun(2, [*_args(model, data, b, *TWO, *extra), f"dist.strategy={strategy}"])
    _ok(done)
    return a, b


def _assert_same_metrics(a: Path, b: Path, names: tuple[str, ...]) -> None:
    """The objective's metrics of every step: the window's means over both ranks' examples."""
    ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    for name in names:
        got, want = [r[name] for r in rb], [r[name] for r in ra]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), name


DPO_CASES = [
    ("ddp", "lora"),
    pytest.param("ddp", "full", marks=pytest.mark.slow),
    pytest.param("fsdp2", "lora", marks=pytest.mark.slow),
    ("fsdp2", "full"),
    # ZeRO-3 (the default stage): each run about 75 s.
    pytest.param("deepspeed", "lora", marks=pytest.mark.slow),
    pytest.param("deepspeed", "full", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("strategy", "method"), DPO_CASES)
def test_dpo_on_two_processes_updates_as_one_with_twice_the_micro_batch(
    tiny_llama_dir: Path, tmp_path: Path, strategy: str, method: str
) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    extra = ("train.objective=dpo", f"method.name={method}")
    one, two = _one_and_two(tiny_llama_dir, data, tmp_path, strategy, ONE, *extra)
    _assert_same_run(one, two)
    _assert_same_metrics(one, two, METRICS)
    first = read_metrics(two / "metrics.jsonl")[0]
    # The policy is its reference before the first update, on every rank: had a rank read
    # another sequence's reference (or its own shard's with another numbering), it would
    # not be 0.
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert read_metrics(two / "metrics.jsonl")[-1]["rewards/margins"] > 0  # it trained


@pytest.mark.slow
@pytest.mark.parametrize(
    ("objective", "strategy", "method", "names"),
    [
        ("simpo", "ddp", "lora", METRICS),
        ("orpo", "fsdp2", "full", ("log_odds_ratio", "logps/chosen", "logps/rejected")),
        ("kto", "fsdp2", "lora", ("kl", "logps/chosen", "logps/rejected")),
    ],
)
def test_simpo_orpo_and_kto_on_two_processes_update_as_one(
    tiny_llama_dir: Path,
    tmp_path: Path,
    objective: str,
    strategy: str,
    method: str,
    names: tuple[str, ...],
) -> None:
    """KTO estimates its KL term per micro-batch (each prompt with the next completion), so
    its one process takes the same micro-batches as the two ranks do (2 rows, 4 per step)."""
    rows = UNPAIRED if objective == "kto" else PAIRS
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    one = TWO if objective == "kto" else ONE
    extra = (f"train.objective={objective}", f"method.name={method}")
    a, b = _one_and_two(tiny_llama_dir, data, tmp_path, strategy, one, *extra)
    _assert_same_run(a, b)
    _assert_same_metrics(a, b, names)


@pytest.mark.slow
def test_dpo_from_a_lora_sft_run_on_two_processes_updates_as_one(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The two-stage recipe under torchrun (70 s on a loaded 2-core machine): model.path is a
    LoRA SFT run, whose adapter rank 0 merges into its base in the DPO run's start_model/ while
    rank 1 waits; both then train from it. The 2-process run makes the updates the one-process
    run from the same SFT run makes, both start at the SFT model (margin 0: the policy is its
    reference), and the record names the SFT run."""
    sft = tmp_path / "sft"
    chats = write_jsonl(tmp_path / "chats.jsonl", chat_rows(8))
    sft_settings = ("method.name=lora", "train.max_steps=2", "train.precision=fp32")
    recipe.train(make_config(tiny_llama_dir, chats, sft, *sft_settings), log=lambda _: None)
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    extra = ("train.objective=dpo", "method.name=lora")
    one, two = _one_and_two(sft, data, tmp_path, "ddp", ONE, *extra)
    _assert_same_run(one, two)
    _assert_same_metrics(one, two, METRICS)
    assert read_metrics(two / "metrics.jsonl")[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    for run in (one, two):
        started = json.loads((run / "leantune_run.json").read_text())["started_from"]
        assert started["run"] == str(sft.resolve())
    # The same merged model: the SFT adapter on its base, written once by rank 0.
    merged = [load_file(run / "start_model" / "model.safetensors") for run in (one, two)]
    assert merged[0].keys() == merged[1].keys()
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in merged[0])
