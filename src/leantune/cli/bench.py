"""The flags of `leantune bench methods`, `bench throughput` and `bench preference` (they run in
`cli.commands.bench`, `leantune.bench.throughput` and `leantune.bench.preference`)."""

from __future__ import annotations

from typing import Any

from leantune.bench.preference_args import add_arguments as preference_arguments
from leantune.bench.throughput_args import add_arguments as throughput_arguments
from leantune.cli.args import count, runs


def add_parsers(sub: Any) -> None:
    """`bench methods`, `bench throughput` and `bench preference`."""
    b = sub.add_parser(
        "bench",
        help="benchmarks: `bench methods` (fine-tuning methods), `bench throughput` (vs HF), "
        "`bench preference` (DPO vs TRL)",
    )
    bsub = b.add_subparsers(dest="bench", required=True)
    bm = bsub.add_parser("methods", help="train each method on the same data and compare")
    bm.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    bm.add_argument("--methods", default=None, help="comma-separated (default: all)")
    bm.add_argument(
        "--steps", type=count(1), default=None, help="override train.max_steps (default: config's)"
    )
    bm.add_argument(
        "--lr",
        default=None,
        help="per-method rates, e.g. lora=2e-3,full=5e-5 (default: each method's default lr)",
    )
    bm.add_argument("--out", default="runs/bench-methods", help="output folder")
    bm.add_argument(
        "--reuse",
        action="store_true",
        help="read back methods whose run in --out already finished instead of training again",
    )
    bm.add_argument(
        "--task",
        choices=["instructions"],
        default=None,
        help="train on a generated task: instructions = alpaca-style instructions with free-text "
        "answers (bench/instructions.py; default: the config's data)",
    )
    bm.add_argument(
        "--sweep",
        action="store_true",
        help="sweep each method's learning rate instead (short runs, picked by held-out loss)",
    )
    bm.add_argument(
        "--grid",
        default=None,
        help="--sweep: rates per method, e.g. ia3=1e-2:3e-2:1e-1 (default: --points rates "
        "--factor apart around --lr or the method's default)",
    )
    bm.add_argument("--points", type=count(1), default=3, help="--sweep: rates per method")
    bm.add_argument(
        "--factor",
        type=float,
        default=3.16,
        help="--sweep: ratio of neighbouring rates (default: 3.16, half a decade)",
    )
    runs(bm, "leantune.cli.commands.bench:cmd_bench")
    bt = bsub.add_parser("throughput", help="leantune against HF Trainer + PEFT on the same work")
    throughput_arguments(bt)
    runs(bt, "leantune.bench.throughput:report")
    bp = bsub.add_parser("preference", help="leantune's DPO against TRL's DPOTrainer, same pairs")
    preference_arguments(bp)
    runs(bp, "leantune.bench.preference:report")
