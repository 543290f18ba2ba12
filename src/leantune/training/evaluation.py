"""Evaluation inside a training run: before training, every `train.eval_every` steps, at the end.

Held-out loss and perplexity on the eval rows, and greedy exact match on chat/alpaca
conversations, with an out-of-memory error halving only the eval batch. A preference objective's
(`PreferenceEval`): its loss and reward metrics on the held-out examples.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.core.precision import autocast
from leantune.core.writes import replacing
from leantune.data.dataset import PreparedData
from leantune.data.formats import Record
from leantune.eval.exact_match import answers_match, evaluate_exact_match, reference_answer_cap
from leantune.eval.perplexity import evaluate_loss
from leantune.eval.preference import evaluate_objective
from leantune.models.attention import sdpa_attention
from leantune.monitor.events import EventLog
from leantune.monitor.metrics import GenerationBar
from leantune.objectives.batch import PreferenceStep
from leantune.training.guard.oom import retry_on_oom
from leantune.training.hooks import StepHooks
from leantune.training.state.checkpoint import capture_rng_state, restore_rng_state

T = TypeVar("T")
Evaluator = Callable[[int], dict[str, Any]]
"""train.eval_every's evaluation after a step: the step -> one row for eval.jsonl."""


@dataclass(frozen=True)
class EvalSettings:
    """How evaluation computes: autocast precision, batch size, generation length."""

    precision: str
    batch_size: int
    max_new_tokens: int
    progress: bool = False
    """Show exact match's progress line (run.progress, on the main process, on a terminal)."""


@dataclass(frozen=True)
class EvalInputs:
    """What evaluation reads (the eval data and its tokenizer) and reports to."""

    tokenizer: PreTrainedTokenizerBase
    data: PreparedData
    pad_id: int
    events: EventLog
    hooks: StepHooks
    """The run's fault hooks: `before_eval` runs before each evaluation attempt."""


def answer_cap(
    setting: int | str,
    tokenizer: PreTrainedTokenizerBase,
    data: PreparedData | None,
    log: Callable[[str], None] | None,
) -> int:
    """train.max_new_tokens as exact match uses it: an integer as it is; auto the cap
    `leantune eval` gives `data`'s reference answers (`reference_answer_cap`), told to `log`."""
    if setting != "auto":
        return int(setting)
    # The last turn of each conversation is the reference, as exact match reads it.
    records = data.records if data is not None else []
    references = [r.messages[-1]["content"] for r in records if r.messages is not None]
    cap, line = reference_answer_cap(tokenizer, references, "train.max_new_tokens")
    if references and log is not None:
        log(line)
    return cap


def evaluate_retrying(
    fn: Callable[[int], T],
    batch_size: int,
    *,
    events: EventLog,
    hooks: StepHooks,
    device: torch.device,
    step: int = 0,
) -> T:
    """Run evaluation, halving only the eval batch on OOM (the training batch never changes).

    `step` is the number of training steps done, for the event.
    """

    def on_retry(old: int, new: int, error: str) -> None:
        message = f"{error}; eval batch {old} -> {new} (training micro-batch unchanged)"
        events.emit("oom_eval", step, message, eval_batch_size=new)

    return retry_on_oom(fn, batch_size, on_retry, device, hooks.before_eval)


def exact_match(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    records: list[Record],
    settings: EvalSettings,
    batch_size: int,
    predictions_file: Path | None = None,
) -> float:
    """Greedy exact match on the records' conversations; optionally writes every prediction."""
    # Only conversations have an answer to match; the records are kept to name each line.
    records = [r for r in records if r.messages is not None]
    convs = [list(r.messages) for r in records if r.messages is not None]
    device = next(model.parameters()).device
    # Cleared when done: the run's own lines (the eval row, the step bar) say what came of it.
    bar = GenerationBar("exact match", enabled=settings.progress, leave=False)
    with autocast(device.type, settings.precision):
        try:
            score, preds = evaluate_exact_match(
                cast(PreTrainedModel, model),
                tokenizer,
                convs,
                batch_size,
                settings.max_new_tokens,
                on_progress=bar,
            )
        finally:
            bar.close()
    if predictions_file is not None:
        with replacing(predictions_file) as tmp, tmp.open("x", encoding="utf-8") as f:
            for rec, conv, pred in zip(records, convs, preds, strict=True):
                ref = conv[-1]["content"]  # the last turn is the answer the model was asked for
                row = {"line": rec.line, "reference": ref, "prediction": pred}
                row["match"] = answers_match(pred, ref)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return score


def _retrying(
    fn: Callable[[int], T], model: nn.Module, inputs: EvalInputs, settings: EvalSettings, step: int
) -> T:
    device = next(model.parameters()).device
    with sdpa_attention(model):  # a training attention (segments) is for packed training only
        return evaluate_retrying(
            fn,
            settings.batch_size,
            events=inputs.events,
            hooks=inputs.hooks,
            device=device,
            step=step,
        )


def _heldout_loss(
    model: nn.Module, inputs: EvalInputs, settings: EvalSettings, step: int
) -> dict[str, Any]:
    """Loss and perplexity on every eval row (the eval batch halves on OOM)."""
    rows, pad_id = inputs.data.rows, inputs.pad_id
    ev = _retrying(
        lambda bs: evaluate_loss(model, rows, pad_id, bs, settings.precision),
        model,
        inputs,
        settings,
        step,
    )
    return {"eval_loss": ev["loss"], "eval_perplexity": ev["perplexity"]}


def exact_match_before(
    model: nn.Module, inputs: EvalInputs, settings: EvalSettings, log: Callable[[str], None]
) -> float:
    """Exact match of the base model on every eval record, before training (and logged)."""
    t0 = time.perf_counter()
    records = inputs.data.records
    score = _retrying(
        lambda bs: exact_match(model, inputs.tokenizer, records, settings, bs),
        model,
        inputs,
        settings,
        0,
    )
    log(
        f"exact match before training: {score:.1%} "
        f"({len(records)} examples, {time.perf_counter() - t0:.0f} s)"
    )
    return score


def evaluate_after(
    model: nn.Module,
    inputs: EvalInputs,
    settings: EvalSettings,
    *,
    predictions_file: Path | None,
    step: int,
) -> dict[str, Any]:
    """The end of a run: loss and perplexity on every eval row, and with a `predictions_file`
    exact match on every record (each prediction written there)."""
    results = _heldout_loss(model, inputs, settings, step)
    if predictions_file is not None:
        records = inputs.data.records
        results["eval_exact_match"] = _retrying(
            lambda bs: exact_match(
                model, inputs.tokenizer, records, settings, bs, predictions_file
            ),
            model,
            inputs,
            settings,
            step,
        )
    return results


@dataclass
class PeriodicEval:
    """`train.eval_every`: eval loss on the eval rows and exact match on a fixed sample."""

    model: nn.Module
    inputs: EvalInputs
    settings: EvalSettings
    exact_match_sample: int

    def __call__(self, step: int) -> dict[str, Any]:
        """Evaluate after `step` updates; returns one row for eval.jsonl."""
        # Evaluation must not perturb training: the mode and every RNG are put back, so a run
        # with eval_every draws the same dropout as one without.
        rng = capture_rng_state()
        was_training = self.model.training
        model, inputs, settings = self.model, self.inputs, self.settings
        try:
            row: dict[str, Any] = {"step": step, **_heldout_loss(model, inputs, settings, step)}
            sample = [r for r in inputs.data.records if r.messages is not None]
            # The same first records every time, so the scores of successive steps compare.
            sample = sample[: self.exact_match_sample]
            if sample:
                row["eval_exact_match"] = _retrying(
                    lambda bs: exact_match(model, inputs.tokenizer, sample, settings, bs),
                    model,
                    inputs,
                    settings,
                    step,
                )
                row["eval_exact_match_examples"] = len(sample)
        finally:
            self.model.train(was_training)
            restore_rng_state(rng)
        return row


@dataclass
class PreferenceEval:
    """A preference objective's held-out evaluation: its loss and reward metrics on data.eval
    (`eval_loss`, `eval_rewards/...`; for pairs `eval_preference_accuracy` and
    `eval_mean_margin`, what `leantune eval --data` reports), every `train.eval_every` steps
    and at the end."""

    model: nn.Module
    step: PreferenceStep
    """The objective on the eval examples, one per row, with the reference's log-probs
    precomputed for full and freeze (adapter methods: the model with its adapters off)."""
    pad_id: int
    settings: EvalSettings
    events: EventLog
    hooks: StepHooks

    def results(self, step: int) -> dict[str, Any]:
        """The eval_* fields after `step` updates (the closing evaluation's, for summary.json)."""
        # As PeriodicEval: the mode and every RNG are put back, so evaluating never changes
        # the training trajectory.
        rng = capture_rng_state()
        was_training = self.model.training
        device = next(self.model.parameters()).device

        def score(batch_size: int) -> dict[str, Any]:
            with autocast(device.type, self.settings.precision):
                return evaluate_objective(self.model, self.step, self.pad_id, batch_size)

        try:
            found = evaluate_retrying(
                score,
                self.settings.batch_size,
                events=self.events,
                hooks=self.hooks,
                device=device,
                step=step,
            )
        finally:
            self.model.train(was_training)
            restore_rng_state(rng)
        return {f"eval_{name}": value for name, value in found.items()}

    def __call__(self, step: int) -> dict[str, Any]:
        """Evaluate after `step` updates; returns one row for eval.jsonl."""
        return {"step": step, **self.results(step)}
