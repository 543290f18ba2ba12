"""The end of a run: final/ (the trained model as plain tools read it), the closing evaluation
and summary.json."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from leantune.core.allocator import mapped_allocator
from leantune.core.precision import pick_device
from leantune.layout import RunPaths
from leantune.methods.artifacts import save_final
from leantune.methods.registry import apply_method, merge_for_inference
from leantune.models.loading import resolve_model
from leantune.monitor.metrics import memory_stats
from leantune.monitor.report import report_at_end
from leantune.training.build import Session, base_model
from leantune.training.evaluation import evaluate_after
from leantune.training.run.summary import write_summary
from leantune.training.run_setup import seed_everything

Log = Callable[[str], None]


def finish(session: Session, *, log: Log, started: float) -> dict[str, Any]:
    """Write final/, run the closing evaluation and write summary.json."""
    s, tr = session, session.trainer
    cfg, files = s.cfg, tr.files
    memory = {"train_peak_mem_bytes": memory_stats(tr.device)["peak_mem_bytes"]}
    if s.load_peak_bytes is not None:
        memory["load_peak_mem_bytes"] = s.load_peak_bytes
    model = tr.strategy.final_model(s.model, lambda: _rebuilt(s))
    if model is None:  # not the main process: it helped gather the weights, and is done
        return {}
    save_final(
        model,
        s.tokenizer,
        RunPaths(files.run_dir).final,
        _base_path(cfg.model.path),
        base_gguf_file=cfg.model.gguf_file,
        rope_scaling=cfg.model.rope_scaling,
        quantization=s.quantization,
    )
    results: dict[str, Any] = {"final_train_loss": tr.progress.last_loss, **memory}
    if s.preference_eval is not None:
        # Before any merge: an adapter method's reference is the model with its adapters off.
        results |= s.preference_eval.results(tr.state.step)
    if s.eval_inputs is not None:
        # Only after save_final: final/ keeps the method's own form (an adapter stays one), and
        # the merge only makes the closing evaluation's generation cheaper.
        merge_for_inference(model)
        preds = RunPaths(files.run_dir).eval_predictions if cfg.train.eval_exact_match else None
        results |= evaluate_after(
            model, s.eval_inputs, s.eval_settings, predictions_file=preds, step=tr.state.step
        )
    results["wall_time_s"] = round(time.perf_counter() - started, 2)  # this invocation
    if pick_device(cfg.train.device).type == "cpu":
        results["allocator"] = mapped_allocator()[0]  # what ran, for comparing runs
    summary = write_summary(
        files.run_dir,
        tr.state,
        tr.progress,
        s.coverage.trainable,
        s.coverage.total,
        results,
        log,
        adapted=s.coverage.as_dict(),
        started_from=files.started_from,
    )
    if cfg.monitor.report:
        report_at_end(files.run_dir, log)
    return summary


def _rebuilt(s: Session) -> nn.Module:
    """The base model with the method applied again, unsharded (FSDP2's final/ on rank 0)."""
    device = pick_device(s.cfg.train.device)
    source = resolve_model(s.cfg.model.path, s.cfg.model.gguf_file)
    # Seeded as in wrap_method: only the trainable weights are gathered into this model, so
    # any weight the method creates and never trains must start as the trained model's did.
    seed_everything(s.cfg.train.seed)
    return apply_method(base_model(s.cfg, source, s.quantization, device), s.cfg.method)


def _base_path(path: str) -> str:
    # A local base is recorded by its absolute path, so final/ still finds it from another
    # working directory; a hub id stays as given.
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path
