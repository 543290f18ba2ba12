"""The supervised fine-tuning recipe: one loop for every method, read top to bottom.

`train(cfg)` builds components in dependency order (tokenizer -> data -> model -> method ->
optimizer -> schedule -> checkpoint state), then runs the step: forward -> loss -> backward ->
accumulate -> unscale -> clip -> step -> log -> save. The method only decides how the model is
wrapped and which parameters train; the loop never branches on it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import Config, dump_config, validate
from leantune.data.dataset import PreparedData, prepare_file
from leantune.data.loader import BatchSchedule, collate
from leantune.eval.exact_match import answers_match, evaluate_exact_match
from leantune.eval.loss import evaluate_loss
from leantune.memory.planner import plan_for_run
from leantune.methods.registry import (
    DEFAULT_LR,
    apply_method,
    count_parameters,
    merge_for_inference,
    trainable_named_parameters,
)
from leantune.models.artifacts import save_final
from leantune.models.loading import (
    enable_gradient_checkpointing,
    load_model,
    load_tokenizer,
    resolve_model,
)
from leantune.training.checkpoint import (
    TrainingState,
    capture_rng_state,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from leantune.training.loss import count_supervised, token_loss_sum
from leantune.training.metrics import MetricsLog, memory_stats, progress_bar
from leantune.training.optim import build_optimizer, build_scheduler
from leantune.training.precision import (
    autocast,
    bf16_slowdown_on_cpu,
    make_grad_scaler,
    pick_device,
)
from leantune.training.summary import write_summary

Log = Callable[[str], None]
# Test hook: SIGKILL this process right after the backward of this global micro-batch index.
FAULT_ENV = "LEANTUNE_KILL_AFTER_MICRO_BATCH"


@dataclass
class Trainer:
    """Everything the step needs, built once by `train`."""

    model: nn.Module
    params: dict[str, nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    schedule: BatchSchedule
    data: PreparedData
    pad_id: int
    device: torch.device
    state: TrainingState


def seed_everything(seed: int) -> None:
    """Seed python, numpy (if present) and torch."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def load_datasets(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, log: Log
) -> tuple[PreparedData, PreparedData | None]:
    """Validate and tokenise the train (and eval) files; bad lines are reported, not hidden."""
    d = cfg.data
    assert d.train is not None
    prepared: list[PreparedData | None] = []
    for path, limit in ((d.train, None), (d.eval, cfg.train.eval_limit)):
        if path is None:
            prepared.append(None)
            continue
        data = prepare_file(
            path,
            d.format,
            tokenizer,
            d.max_seq_len,
            d.pack,
            d.system_prompt,
            d.max_bad_fraction,
            limit,
        )
        for bad in data.bad[:20]:
            log(f"bad line skipped: {bad}")
        if len(data.bad) > 20:
            log(f"... {len(data.bad) - 20} more bad lines in {path}")
        log(
            f"data {Path(path).name}: {len(data.examples)} examples, {len(data.rows)} rows, "
            f"{data.supervised_tokens} supervised tokens, {len(data.bad)} bad lines"
        )
        prepared.append(data)
    train_data, eval_data = prepared
    assert train_data is not None
    return train_data, eval_data


def restore(trainer: Trainer, ckpt_dir: Path, log: Log) -> None:
    """Continue from the newest complete checkpoint: weights, optimizer, schedule, scaler, RNG
    and the exact data position."""
    path = latest_checkpoint(ckpt_dir)
    if path is None:
        return
    ckpt = load_checkpoint(path)
    if set(ckpt.weights) != set(trainer.params):
        raise RuntimeError(
            f"{path}: checkpoint weights do not match the model's trainable parameters "
            f"(was it written with another method or model?)"
        )
    with torch.no_grad():
        for name, tensor in ckpt.weights.items():
            trainer.params[name].copy_(tensor)
    trainer.optimizer.load_state_dict(ckpt.optimizer)
    trainer.scheduler.load_state_dict(ckpt.scheduler)
    if trainer.scaler is not None and ckpt.scaler is not None:
        trainer.scaler.load_state_dict(ckpt.scaler)
    restore_rng_state(ckpt.rng)
    trainer.state = ckpt.state
    log(f"resumed from {path} at step {ckpt.state.step}")


def checkpoint(trainer: Trainer, ckpt_dir: Path, keep_last: int, config_yaml: str) -> Path:
    """Write a checkpoint of the current state (atomic; see training.checkpoint)."""
    return save_checkpoint(
        ckpt_dir,
        trainer.state,
        weights={n: p.detach() for n, p in trainer.params.items()},
        optimizer=trainer.optimizer.state_dict(),
        scheduler=trainer.scheduler.state_dict(),
        scaler=trainer.scaler.state_dict() if trainer.scaler is not None else None,
        rng=capture_rng_state(),
        keep_last=keep_last,
        metadata={"config": config_yaml},
    )


def _inject_fault(micro_batch: int) -> None:
    target = os.environ.get(FAULT_ENV)
    if target is not None and int(target) == micro_batch:
        os.kill(os.getpid(), signal.SIGKILL)


def backward_window(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    precision: str,
    scaler: torch.amp.GradScaler | None = None,
    first_micro_batch: int = 0,
    kl_coef: float = 0.0,
) -> float:
    """Accumulate gradients over one optimizer step's micro-batches; returns the window's loss.

    Each micro-batch's summed token loss is divided by the supervised tokens of the whole
    window, so k micro-batches give the same gradient as one k-times larger batch.
    """
    n_supervised = max(1, sum(count_supervised(b["labels"]) for b in batches))
    loss_sum = torch.zeros((), dtype=torch.float64)
    for k, batch in enumerate(batches):
        batch = {key: v.to(device) for key, v in batch.items()}
        with autocast(device.type, precision):
            loss = token_loss_sum(model, batch, kl_coef) / n_supervised
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += loss.detach().double().cpu()
        _inject_fault(first_micro_batch + k)
    return float(loss_sum)


def train_step(
    tr: Trainer, grad_accum: int, precision: str, max_grad_norm: float, kl_coef: float = 0.0
) -> dict[str, Any]:
    """One optimizer step over `grad_accum` micro-batches; returns the step's metrics."""
    start = time.perf_counter()
    first = tr.state.micro_batches_seen
    window = [
        [tr.data.rows[i] for i in tr.schedule.indices(k)] for k in range(first, first + grad_accum)
    ]
    batches = [collate(rows, tr.pad_id) for rows in window]
    loss = backward_window(tr.model, batches, tr.device, precision, tr.scaler, first, kl_coef)
    tr.state.micro_batches_seen += grad_accum
    if tr.scaler is not None:
        tr.scaler.unscale_(tr.optimizer)
    grads = list(tr.params.values())
    clip_to = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, clip_to))
    lr = tr.scheduler.get_last_lr()[0]
    stepped = True
    if tr.scaler is not None:
        scale_before = tr.scaler.get_scale()
        tr.scaler.step(tr.optimizer)
        tr.scaler.update()
        stepped = tr.scaler.get_scale() >= scale_before  # a skipped step lowers the scale
    else:
        tr.optimizer.step()
    if stepped:
        tr.scheduler.step()
    tr.optimizer.zero_grad(set_to_none=True)
    tr.state.step += 1
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.input_ids) for rows in window for r in rows)
    return {
        "step": tr.state.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "supervised_tokens": sum(count_supervised(b["labels"]) for b in batches),
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed,
        **memory_stats(tr.device),
        "optimizer_stepped": stepped,
    }


def train(cfg: Config, log: Log = print) -> dict[str, Any]:
    """Run (or resume) a fine-tune described by `cfg`; returns the run summary."""
    started = time.perf_counter()
    for warning in validate(cfg):
        log(f"warning: {warning}")
    t = cfg.train
    run_dir = cfg.run_dir
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    config_yaml = (run_dir / "config.yaml").read_text()
    seed_everything(t.seed)
    device = pick_device(t.device)
    if device.type == "cpu" and t.precision == "bf16" and (slow := bf16_slowdown_on_cpu()) > 4:
        log(
            f"warning: train.precision=bf16: bf16 matmul is {slow:.0f}x slower than fp32 on this "
            "CPU (no native bf16 units); train.precision=fp32 will be much faster here"
        )

    source = resolve_model(cfg.model.path, cfg.model.gguf_file)
    tokenizer = load_tokenizer(source, cfg.model.trust_remote_code)
    train_data, eval_data = load_datasets(cfg, tokenizer, log)
    t, memory_note = plan_for_run(cfg, device.type, [r.labels for r in train_data.rows])
    log(memory_note)
    model: nn.Module = load_model(
        source, cfg.model.dtype, cfg.model.trust_remote_code, cfg.model.attn_implementation
    )
    model.to(device)
    base_exact_match = None
    fresh = cfg.run.resume == "never" or latest_checkpoint(ckpt_dir) is None
    if t.eval_exact_match and eval_data is not None and fresh:
        # On the bare base model, before any adapter exists (an untrained adapter is a no-op
        # that would only cost time).
        t0 = time.perf_counter()
        base_exact_match = exact_match(model, tokenizer, eval_data, cfg)
        log(
            f"exact match before training: {base_exact_match:.1%} "
            f"({len(eval_data.records)} examples, {time.perf_counter() - t0:.0f} s)"
        )
    seed_everything(t.seed)
    model = apply_method(model, cfg.method)
    if t.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    params = trainable_named_parameters(model)
    trainable, total = count_parameters(model)
    log(
        f"method {cfg.method.name}: {trainable:,} of {total:,} parameters train "
        f"({100 * trainable / total:.3f}%)"
    )
    lr = t.lr if t.lr is not None else DEFAULT_LR[cfg.method.name]
    optimizer = build_optimizer(params, lr, t.weight_decay)
    trainer = Trainer(
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, t.max_steps, t.warmup_ratio, t.min_lr_ratio),
        scaler=make_grad_scaler(t.precision, device.type),
        schedule=BatchSchedule(len(train_data.rows), int(t.micro_batch_size), t.seed),
        data=train_data,
        pad_id=int(tokenizer.pad_token_id),
        device=device,
        state=TrainingState(step=0, micro_batches_seen=0, extra={}),
    )
    if cfg.run.resume == "auto":
        restore(trainer, ckpt_dir, log)
    extra = trainer.state.extra
    if base_exact_match is not None and "base_exact_match" not in extra:
        extra["base_exact_match"] = base_exact_match

    metrics = MetricsLog(run_dir / "metrics.jsonl", trainer.state.step)
    bar = progress_bar(t.max_steps, trainer.state.step, cfg.run.progress)
    model.train()
    while trainer.state.step < t.max_steps:
        record = train_step(trainer, t.grad_accum, t.precision, t.max_grad_norm, t.kl_coef)
        extra["train_time_s"] = extra.get("train_time_s", 0.0) + record["step_time_s"]
        extra["last_loss"] = record["loss"]
        metrics.write(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        bar.update(1)
        step = trainer.state.step
        if (t.save_every and step % t.save_every == 0) or step == t.max_steps:
            checkpoint(trainer, ckpt_dir, t.keep_last, config_yaml)
    bar.close()

    save_final(model, tokenizer, run_dir / "final", _base_path(cfg.model.path), cfg.model.gguf_file)
    results: dict[str, Any] = {"final_train_loss": extra.get("last_loss")}
    if eval_data is not None:
        t0 = time.perf_counter()
        merge_for_inference(model)
        ev = evaluate_loss(model, eval_data.rows, trainer.pad_id, t.eval_batch_size, t.precision)
        results.update(eval_loss=ev["loss"], eval_perplexity=ev["perplexity"])
        if t.eval_exact_match:
            preds_file = run_dir / "eval_predictions.jsonl"
            results["eval_exact_match"] = exact_match(model, tokenizer, eval_data, cfg, preds_file)
    results["wall_time_s"] = round(time.perf_counter() - started, 2)  # this invocation
    return write_summary(run_dir, trainer.state, trainable, total, results, log)


def exact_match(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    data: PreparedData,
    cfg: Config,
    predictions_file: Path | None = None,
) -> float:
    """Greedy exact match on the eval conversations; optionally writes every prediction."""
    convs = [list(r.messages) for r in data.records if r.messages is not None]
    device = next(model.parameters()).device
    with autocast(device.type, cfg.train.precision):
        score, preds = evaluate_exact_match(
            cast(PreTrainedModel, model),
            tokenizer,
            convs,
            cfg.train.eval_batch_size,
            cfg.train.max_new_tokens,
        )
    if predictions_file is not None:
        with predictions_file.open("w", encoding="utf-8") as f:
            for rec, conv, pred in zip(data.records, convs, preds, strict=True):
                ref = conv[-1]["content"]
                row = {"line": rec.line, "reference": ref, "prediction": pred}
                row["match"] = answers_match(pred, ref)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return score


def _base_path(path: str) -> str:
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path
