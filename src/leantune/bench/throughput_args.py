"""What the parts of `leantune bench throughput` share, apart from the benchmark itself: its
options (`leantune --help` builds them without loading torch) and the baseline's result file
(the baseline's own process, `bench.hf_baseline`, must not load leantune's training code: its
memory is what is measured)."""

from __future__ import annotations

import argparse
import os

METHODS = ("lora", "full")
"""What both systems can train the same way."""
BASELINE_RESULT = "result.json"
"""What `bench.hf_baseline` writes into its --out folder (the baseline's summary)."""
HF_BATCH = 8
"""The baseline's batch per optimizer update (Trainer's usual per-device batch)."""
BENCH_SHAPES = ("tiny", "0.5b", "1.5b")
"""`--model-shape` choices: `bench.model_shapes.SHAPES` that both systems train in LoRA and full
(7B is QLoRA's, which the baseline does not run: benchmarks/qlora_step.py times its step)."""
UPDATES = ("both", "defaults", "same")
"""`--updates`: leantune with its defaults (packed rows, about HF_BATCH examples per update on
average), with the baseline's updates (HF_BATCH examples each, so as many updates), or both."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (on `leantune bench throughput` and `benchmarks/vs_hf.py`)."""
    p.add_argument("--model", default="smollm2-135m-instruct", help="model both systems train")
    p.add_argument(
        "--model-shape",
        choices=BENCH_SHAPES,
        default=None,
        help="train a model of Qwen2.5-0.5B's or 1.5B's published shape with random weights "
        "instead of --model (built from config in the --out folder, nothing downloaded; "
        "default: none, --model's weights)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="with --model-shape: a tokenizer folder (default: the demo model's)",
    )
    p.add_argument(
        "--updates",
        choices=UPDATES,
        default="both",
        help=f"defaults: leantune's own batch (packed rows holding about {HF_BATCH} examples "
        f"per update, so its own number of updates); same: {HF_BATCH} examples per update, one "
        "per row (no packing, no padding), as many updates as the baseline; both: the two "
        "comparisons against the same baseline runs",
    )
    p.add_argument("--conversations", type=count, default=128, help="training conversations")
    p.add_argument("--heldout", type=count, default=32, help="held-out conversations (the judge)")
    p.add_argument("--min-tokens", type=count, default=40, help="shortest conversation (target)")
    p.add_argument("--max-tokens", type=count, default=1200, help="longest conversation (target)")
    p.add_argument("--reps", type=count, default=3, help="repetitions, alternating who goes first")
    p.add_argument("--methods", type=_methods, default=list(METHODS), help=",".join(METHODS))
    p.add_argument("--threads", type=count, default=os.cpu_count() or 1, help="intra-op threads")
    p.add_argument("--max-seq-len", type=count, default=2048, help="longest example kept")
    p.add_argument("--out", default="runs/bench-throughput", help="working folder")
    p.add_argument(
        "--keep-models",
        action="store_true",
        help="keep each run's trained weights and checkpoints (default: removed once the run's "
        "held-out loss is computed; the 0.5B runs of lora and full took 20 GB)",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="auto: what this CPU runs fastest (leantune's train.precision=auto, the baseline "
        "the same); fp32 or bf16: both systems in that precision (fp32 stands in for a CPU "
        "without fast bf16 matmul, where auto picks fp32)",
    )
    p.add_argument(
        "--hf-micro-batch",
        type=_micro_batch,
        default=HF_BATCH,
        help=f"the baseline's micro-batch: {HF_BATCH} examples per update either way, the rest "
        "by gradient accumulation (what a user does when batch 8 runs out of memory)",
    )


def count(text: str) -> int:
    """A whole number >= 1 (0 conversations or repetitions leave nothing to measure)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or not set(names) <= set(METHODS):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(METHODS)}, got {text!r}")
    return list(dict.fromkeys(names))  # a method named twice runs once, in the order given


def _micro_batch(text: str) -> int:
    n = count(text)
    # A divisor: micro-batch x accumulation must make exactly HF_BATCH examples per update.
    if n < 1 or HF_BATCH % n:
        raise argparse.ArgumentTypeError(f"must divide {HF_BATCH} (1, 2, 4 or 8), not {n}")
    return n
