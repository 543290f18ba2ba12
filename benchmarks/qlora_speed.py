"""CPU/GPU step time and memory of LoRA vs QLoRA (4-bit NF4 base) on the same batches.

    PYTHONPATH=src python benchmarks/qlora_speed.py [--model smollm2-135m-instruct] [--steps 5]

Prints a table and ends with one JSON line. Each method trains `--steps` optimizer steps on the
same packed rows of the demo data; the first step (allocation, lazy init) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from leantune.core.optim import build_optimizer
from leantune.data.dataset import prepared_data
from leantune.data.loader import collate
from leantune.data.prepare.records import PrepareSettings
from leantune.methods.registry import (
    apply_method,
    base_quantization,
    count_parameters,
    trainable_named_parameters,
)
from leantune.models.loading import load_model, load_tokenizer, resolve_model
from leantune.training.checks import load_config
from leantune.training.trainer import backward_window

DEMO_TRAIN = Path(__file__).resolve().parents[1] / "src/leantune/demo/data/support_train.jsonl"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters as stored (4-bit codes count as packed bytes; scales excluded)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure(name: str, args: argparse.Namespace, rows: list, device: torch.device) -> dict:
    cfg = load_config(None, [f"method.name={name}", f"method.double_quant={args.double_quant}"])
    source = resolve_model(args.model)
    quant = base_quantization(cfg.method, "fp32")
    model = load_model(source, quantization=quant, device=device).to(device)
    torch.manual_seed(0)
    model = apply_method(model, cfg.method)
    params = trainable_named_parameters(model)
    opt = build_optimizer(params, 2e-4, 0.0, "adamw", device.type)
    model.train()
    times, losses = [], []
    for step in range(args.steps + 1):
        batch = collate([rows[(step * args.batch + i) % len(rows)] for i in range(args.batch)], 0)
        start = time.perf_counter()
        losses.append(backward_window(model, [batch], device, "fp32"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    trainable, _ = count_parameters(model)
    return {
        "method": name,
        "first_step_s": round(times[0], 3),
        "median_step_s": round(statistics.median(times[1:]), 3),
        "param_mb": round(weight_bytes(model) / 2**20, 1),
        "trainable": trainable,
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1, help="packed rows per step")
    ap.add_argument("--seq", type=int, default=512, help="packed row length")
    ap.add_argument("--double-quant", default="true", choices=["true", "false"])
    ap.add_argument("--data", default=str(DEMO_TRAIN))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(resolve_model(args.model))
    settings = PrepareSettings("chat", args.seq, pack=True)
    data = prepared_data(args.data, settings=settings, tokenizer=tok, max_bad_fraction=1.0)
    rows = data.rows[: (args.steps + 1) * args.batch]
    results = [measure(name, args, rows, device) for name in ("lora", "qlora")]
    cols = list(results[0])
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in results:
        print(" | ".join(f"{r[c]!s:>14}" for c in cols))
    ratio = results[1]["median_step_s"] / max(results[0]["median_step_s"], 1e-9)
    print(f"qlora/lora step time: {ratio:.2f}x on {device.type}, threads={torch.get_num_threads()}")
    print(json.dumps({"device": device.type, "qlora_over_lora": round(ratio, 2), "runs": results}))


if __name__ == "__main__":
    main()
