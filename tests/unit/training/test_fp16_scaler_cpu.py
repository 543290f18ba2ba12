"""The fp16 step (autocast + GradScaler) that CUDA runs, run on CPU with
`torch.amp.GradScaler("cpu")`: a real fp16 overflow is skipped and lowers the scale, the next
steps apply, and checkpoints carry the scaler."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from support import make_config

from leantune.core.precision import PrecisionChoice, make_grad_scaler
from leantune.monitor.metrics import read_metrics
from leantune.training import build, recipe, resolve
from leantune.training.state.checkpoint import latest_checkpoint, load_checkpoint

START_SCALE, BACKOFF = 2.0**40, 2.0**-8
"""So high that the first backward's fp16 gradients overflow (a real inf from fp16 arithmetic,
not an injected one); each overflow divides it by 256, so a few steps reach one that fits."""


def test_make_grad_scaler_scales_fp16_only_on_the_run_device() -> None:
    scaler = make_grad_scaler("fp16", "cpu")
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert scaler.get_scale() == 2.0**16  # torch's default start, as on CUDA
    assert make_grad_scaler("bf16", "cpu") is None and make_grad_scaler("fp32", "cuda") is None


def test_fp16_on_cpu_skips_an_overflowing_step_lowers_the_scale_and_then_trains(
    tiny_llama_dir: Path, chat_files: tuple[Path, Path], tmp_path: Path, monkeypatch: Any
) -> None:
    # resolve_precision refuses fp16 without CUDA: the fake answers as on a CUDA machine, for
    # the precision alone. Autocast, the scaler, unscale, clip and step or skip are the real ones.
    real_resolve = resolve.resolve_precision

    def as_on_cuda(requested: str, device_type: str, *args: Any, **kw: Any) -> PrecisionChoice:
        if requested == "fp16":
            return PrecisionChoice("fp16")
        return real_resolve(requested, device_type, *args, **kw)

    scalers: list[torch.amp.GradScaler] = []

    def high_scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
        scaler = make_grad_scaler(precision, device_type)
        assert scaler is not None
        state = {**scaler.state_dict(), "scale": START_SCALE, "backoff_factor": BACKOFF}
        scaler.load_state_dict(state)
        scalers.append(scaler)
        return scaler

    steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]] = []
    dtypes: set[torch.dtype] = set()
    real_step = recipe.train_step

    def spy(tr: recipe.Trainer) -> recipe.StepResult:
        if not steps:  # what the linear layers compute in, seen on the first step
            for m in tr.model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.register_forward_hook(lambda _m, _i, out: dtypes.add(out.dtype))
        before = {n: p.detach().clone() for n, p in tr.params.items()}
        result = real_step(tr)
        after = {n: p.detach().clone() for n, p in tr.params.items()}
        steps.append((before, after, scalers[0].get_scale()))
        return result

    monkeypatch.setattr(resolve, "resolve_precision", as_on_cuda)
    monkeypatch.setattr(build, "make_grad_scaler", high_scaler)
    monkeypatch.setattr(recipe, "train_step", spy)
    run = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir, chat_files[0], run, "train.precision=fp16", "train.max_steps=6"
    )
    recipe.train(cfg, log=lambda _: None)

    assert dtypes == {torch.float16}  # fp16 autocast was in effect on CPU
    metrics = read_metrics(run / "metrics.jsonl")
    stepped = [m["optimizer_stepped"] for m in metrics]
    assert all(math.isfinite(m["loss"]) for m in metrics)  # the overflow is the gradients'
    scales = [START_SCALE] + [scale for *_, scale in steps]
    assert stepped[0] is False and scales[1] == START_SCALE * BACKOFF
    assert True in stepped, f"no step fitted the scale: {scales}"
    for i, ((before, after, _), ok) in enumerate(zip(steps, stepped, strict=True)):
        unchanged = all(torch.equal(before[n], after[n]) for n in before)
        # A skipped step leaves the weights bit-identical and lowers the scale; an applied one
        # moves the weights and keeps it (growth comes only after 2,000 clean steps).
        assert unchanged == (not ok), i
        assert scales[i + 1] == (scales[i] if ok else scales[i] * BACKOFF), (i, scales)
    assert all(p.dtype == torch.float32 for p in steps[-1][1].values())  # fp32 master weights
    # Not guard events: the scaler handled every overflow.
    assert not (run / "events.jsonl").exists()
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None
    saved = load_checkpoint(ckpt).scaler
    assert saved is not None and saved["scale"] == scales[-1]
