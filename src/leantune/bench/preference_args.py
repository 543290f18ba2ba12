"""The options of `leantune bench preference` (`leantune --help` builds them without loading
torch; the benchmark itself is `bench.preference`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from leantune.bench.preference_pairs import HELDOUT_SOURCE, TRAIN_SOURCE
from leantune.bench.throughput_args import count

TRL_BATCH_PAIRS = 4
"""The baseline's pairs per update: 8 answers, as many as leantune's default global batch holds
(rows that hold about 8 examples, each answer one)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (on `leantune bench preference` and `benchmarks/vs_trl_dpo.py`)."""
    p.add_argument("--model", default="smollm2-135m-instruct", help="model both systems train")
    p.add_argument("--pairs", type=_up_to(TRAIN_SOURCE), default=256, help="training pairs")
    p.add_argument("--heldout", type=_up_to(HELDOUT_SOURCE), default=100, help="held-out pairs")
    p.add_argument("--steps", type=count, default=None, help="optimizer steps (default: one epoch)")
    p.add_argument("--reps", type=count, default=3, help="repetitions, alternating who goes first")
    p.add_argument("--beta", type=float, default=0.1, help="DPO beta, both systems")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate, both systems (default: leantune's for LoRA, given to TRL too)",
    )
    p.add_argument(
        "--trl-batch",
        type=count,
        default=TRL_BATCH_PAIRS,
        help="the baseline's pairs per update (its per_device_train_batch_size)",
    )
    p.add_argument("--threads", type=count, default=os.cpu_count() or 1, help="intra-op threads")
    p.add_argument("--out", default="runs/bench-preference", help="working folder")
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="auto: what this CPU runs fastest (leantune's train.precision=auto, the baseline "
        "the same); fp32 or bf16: both systems in that precision",
    )


def _up_to(source: Path) -> Callable[[str], int]:
    """A count of pairs that `source` (one conversation a line) can make."""

    def parse(text: str) -> int:
        n = count(text)
        have = len(source.read_text().splitlines())
        if n > have:
            raise argparse.ArgumentTypeError(f"{source.name} has {have} conversations, not {n}")
        return n

    return parse
