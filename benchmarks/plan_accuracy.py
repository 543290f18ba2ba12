"""How close is the memory planner? Predicted vs measured peak of real training steps on CPU.

Each grid point runs in a fresh subprocess: it imports everything, runs one warm-up step of a
2-block model with the same method (paging in the kernels' code), reads its RSS (the idle
baseline), builds the model (random init from config, or the cached demo SmolLM2-135M), applies
the method, then runs two optimizer steps (the second has the AdamW states of the first) of the
real loop's code (`backward_window`, clipping, `optimizer.step`) on packed rows of random tokens
with half of each row supervised. Measured = peak RSS (VmHWM) minus the baseline. Predicted =
`Breakdown.run_peak` for the same settings (the planner's peak without its process baseline).

The subprocess runs with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors go back to the
kernel (with glibc's default dynamic threshold, freed 1-32 MB blocks stay in the heap and RSS
overstated live memory by a workload-dependent ~10-35% on this grid, which no planner can
predict) and MKL_DISABLE_FAST_MM=1 so that MKL does not keep its GEMM scratch buffers.
`--default-malloc` also measures each point with the default allocators, `--tcmalloc` with
the tcmalloc that `leantune train` preloads when it is installed (`leantune.core.allocator`;
MKL's fast memory manager on, as in a run): how far RSS runs above the live tensors under each
is what the planner's `estimate.FIT_MARGIN` allows for.

Usage:
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/plan_accuracy.py [--only NAME ...]
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

DEMO = "smollm2-135m-instruct"
SMALL = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
MID = {
    "vocab_size": 16384,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
MODELS: dict[str, dict[str, int] | str] = {"small": SMALL, "mid": MID, "demo": DEMO}

# name: (model, method, micro_batch, seq_len, gradient checkpointing, attention)
GRID: dict[str, tuple[str, str, int, int, bool, str]] = {
    "small-full-b2-t256": ("small", "full", 2, 256, False, "sdpa"),
    "small-lora-b4-t256": ("small", "lora", 4, 256, False, "sdpa"),
    "small-lora-b4-t256-ckpt": ("small", "lora", 4, 256, True, "sdpa"),
    "small-dora-b2-t256": ("small", "dora", 2, 256, False, "sdpa"),
    "small-ia3-b4-t256": ("small", "ia3", 4, 256, False, "sdpa"),
    "small-freeze-b4-t256": ("small", "freeze", 4, 256, False, "sdpa"),
    "small-lora-b2-t256-eager": ("small", "lora", 2, 256, False, "eager"),
    "mid-lora-b2-t512": ("mid", "lora", 2, 512, False, "sdpa"),
    "mid-full-b1-t512-ckpt": ("mid", "full", 1, 512, True, "sdpa"),
    "mid-lora-b4-t256-ckpt": ("mid", "lora", 4, 256, True, "sdpa"),
    "demo-lora-b1-t256": ("demo", "lora", 1, 256, False, "sdpa"),
    "demo-full-b1-t128-ckpt": ("demo", "full", 1, 128, True, "sdpa"),
    # segment attention (model.attn_implementation=segments, what auto picks for packed rows)
    "small-lora-b4-t256-segments": ("small", "lora", 4, 256, False, "segments"),
    "mid-full-b2-t512-segments": ("mid", "full", 2, 512, False, "segments"),
    "mid-lora-b2-t1024-segments": ("mid", "lora", 2, 1024, False, "segments"),
    "demo-lora-b1-t1024-segments": ("demo", "lora", 1, 1024, False, "segments"),
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _config(model: str) -> Any:
    from transformers import AutoConfig, LlamaConfig

    spec = MODELS[model]
    if isinstance(spec, str):
        from leantune.models.loading import resolve_model

        return AutoConfig.from_pretrained(resolve_model(spec).location)
    return LlamaConfig(**spec, tie_word_embeddings=True, max_position_embeddings=2048)


def _batch(vocab: int, micro_batch: int, seq_len: int) -> dict[str, Any]:
    """Packed rows: two examples per row (position ids restart), the second half supervised."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (micro_batch, seq_len), generator=g)
    labels = torch.full_like(ids, -100)
    half = seq_len // 2
    labels[:, half // 2 : half] = ids[:, half // 2 : half]
    labels[:, half + half // 2 :] = ids[:, half + half // 2 :]
    pos = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).repeat(micro_batch, 1)
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _warm_up(method: str, ckpt: bool, attn: str) -> None:
    """One step of a 2-block model with the same method and kernels, then freed: the first step
    pages in the code of the kernels it uses and sets up lazy runtime state (~20 MB of RSS that
    stays), which belongs to the process baseline (the planner's runtime overhead), not to the
    run's tensors."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from leantune.config import MethodConfig
    from leantune.core.optim import build_optimizer
    from leantune.methods.registry import apply_method, trainable_named_parameters
    from leantune.models.attention import transformers_name
    from leantune.models.loading import enable_gradient_checkpointing
    from leantune.training.trainer import backward_window

    dims = {**SMALL, "vocab_size": 512, "num_hidden_layers": 2, "hidden_size": 64}
    dims["intermediate_size"] = 128
    config = LlamaConfig(**dims, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=transformers_name(attn))
    model = apply_method(model, MethodConfig(name=method))  # type: ignore[arg-type]
    if ckpt:
        enable_gradient_checkpointing(model)
    params = trainable_named_parameters(model)
    opt = build_optimizer(params, 1e-4, 0.01)
    model.train()
    backward_window(model, [_batch(512, 2, 32)], torch.device("cpu"), "fp32")
    torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
    opt.step()
    del model, params, opt
    gc.collect()


def worker(name: str) -> dict[str, Any]:
    """Measure one grid point in this (fresh) process."""
    import peft  # noqa: F401  (imported before the baseline, as a real run has it)
    import torch
    from transformers import AutoModelForCausalLM

    from leantune.config import MethodConfig
    from leantune.core.optim import build_optimizer
    from leantune.methods.registry import apply_method, trainable_named_parameters
    from leantune.models.attention import transformers_name
    from leantune.models.loading import enable_gradient_checkpointing, load_model, resolve_model
    from leantune.training.trainer import backward_window

    torch.set_num_threads(1)
    model_name, method, mb, seq, ckpt, attn = GRID[name]
    config = _config(model_name)
    batch = _batch(config.vocab_size, mb, seq)
    _warm_up(method, ckpt, attn)
    base = _status("VmRSS")
    if model_name == "demo":
        model = load_model(resolve_model(DEMO), dtype="fp32", attn_implementation=attn)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=transformers_name(attn)
        )
    model = apply_method(model, MethodConfig(name=method))  # type: ignore[arg-type]
    if ckpt:
        enable_gradient_checkpointing(model)
    params = trainable_named_parameters(model)
    opt = build_optimizer(params, 1e-4, 0.01)
    loaded = _status("VmRSS") - base
    # Loading transients (safetensors mmap, init) are not part of the step: measure from here.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model.train()
    t0 = time.perf_counter()
    for _ in range(2):
        backward_window(model, [batch], torch.device("cpu"), "fp32")
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "measured": _status("VmHWM") - base,
        "loaded": loaded,
        "baseline": base,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def predict(name: str) -> int:
    """The planner's run peak (above the process baseline) for one grid point."""
    from leantune.config import MethodConfig
    from leantune.memory.estimate import StepSettings, estimate
    from leantune.memory.inputs import model_facts_for

    model_name, method, mb, seq, ckpt, attn = GRID[name]
    facts = model_facts_for(
        _config(model_name),
        "fp32",
        attn,
        MethodConfig(name=method),  # type: ignore[arg-type]
    )
    supervised = int((_batch(100, 1, seq)["labels"] != -100).sum())
    st = StepSettings(mb, seq, supervised, ckpt, attn)
    return estimate(facts, st).run_peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="grid points to run (default: all)")
    p.add_argument("--default-malloc", action="store_true", help="also measure with glibc defaults")
    p.add_argument("--tcmalloc", action="store_true", help="also measure with tcmalloc")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    names = args.only or list(GRID)
    from leantune.core.allocator import (
        find_tcmalloc,
        library_dirs,
        preloaded_environment,
        without_leantune_preload,
    )

    env = without_leantune_preload(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    arms = {"tuned": {"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}}
    if args.default_malloc:
        arms["default"] = {}
    if args.tcmalloc:
        library = find_tcmalloc(library_dirs(os.environ))
        if library is None:
            p.error("--tcmalloc: no libtcmalloc here (apt-get install libtcmalloc-minimal4)")
        arms["tcmalloc"] = {
            k: v for k, v in preloaded_environment(env, library).items() if env.get(k) != v
        }
    results = []
    print(f"{'config':28s} {'predicted MiB':>13s} {'measured MiB':>12s} {'error':>7s}", end="")
    print(f" {'glibc MiB':>9s}" if args.default_malloc else "", end="")
    print(f" {'tcmalloc MiB':>12s}" if args.tcmalloc else "", flush=True)
    for name in names:
        runs = {}
        for label, extra in arms.items():
            out = subprocess.run(
                [sys.executable, __file__, "--worker", name],
                env={**env, **extra},
                capture_output=True,
                text=True,
                check=True,
            )
            runs[label] = json.loads(out.stdout.strip().splitlines()[-1])
        pred = predict(name)
        meas = runs["tuned"]["measured"]
        err = (pred - meas) / meas
        row = {"config": name, "predicted": pred, "measured": meas, "error": round(err, 4)}
        row["step_seconds"] = runs["tuned"]["seconds"]
        line = f"{name:28s} {pred / 2**20:13.1f} {meas / 2**20:12.1f} {err:+7.1%}"
        if "default" in runs:
            row["measured_default_malloc"] = runs["default"]["measured"]
            line += f" {runs['default']['measured'] / 2**20:9.1f}"
        if "tcmalloc" in runs:
            row["measured_tcmalloc"] = runs["tcmalloc"]["measured"]
            line += f" {runs['tcmalloc']['measured'] / 2**20:12.1f}"
        print(line, flush=True)
        results.append(row)
    worst = max(abs(r["error"]) for r in results)
    summary = {"configs": len(results), "max_abs_error": round(worst, 4), "target": 0.15}
    summary["within_target"] = worst <= 0.15
    for label in ("default_malloc", "tcmalloc"):  # the most RSS ran above the prediction
        key = f"measured_{label}"
        over = [r[key] / r["predicted"] for r in results if key in r]
        if over:
            summary[f"max_rss_over_predicted_{label}"] = round(max(over), 3)
    print(json.dumps({"summary": summary, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
