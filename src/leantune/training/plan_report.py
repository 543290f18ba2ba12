"""`leantune plan`: the configured run's predicted memory, whether it fits, and what would."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.config import Config
from leantune.data.dataset import prepared_data
from leantune.data.packing import longest_example, rows_for
from leantune.data.preference_dataset import preference_data
from leantune.data.preference_packing import PreferenceRow
from leantune.data.prepare.provenance import TokenizerMismatch
from leantune.data.prepare.records import PrepareSettings
from leantune.data.templates import apply_chat_template
from leantune.memory.budget import budget_for
from leantune.memory.estimate import GIB, MARGIN_MEASURED, estimate, margin_key
from leantune.memory.inputs import max_supervised_per_row, plan_basis
from leantune.memory.planner import (
    alternatives,
    available_optimizers,
    lighter_weights,
    recommend,
)
from leantune.methods.checks import effective_pack
from leantune.models.loading import load_tokenizer
from leantune.objectives.registry import SFT
from leantune.training.planning import plan_inputs
from leantune.training.preference_setup import longest_sequence, preference_rows
from leantune.training.run_setup import (
    FALLBACK_CONTEXT,
    model_context,
    resolved_global_batch,
    with_objective_format,
)
from leantune.training.start_model import start_sources

COMPONENTS = (
    ("overhead", "runtime (python, torch; CUDA context)"),
    ("weights", "weights"),
    ("reference_copy", "reference copy (train.reference=live)"),
    ("optimizer", "optimizer states"),
    ("activations", "activations saved for backward"),
    ("loss", "logits + loss (supervised positions)"),
    ("recompute", "recomputed block (checkpointing)"),
    ("reference", "reference forward (no grad)"),
    ("gradients", "gradients"),
    ("step_temporaries", "optimizer-step temporaries"),
)
LOAD_LABEL = "loading the checkpoint"
REFERENCE_PASS_LABEL = "reference pass before training"


RowStats = tuple[int | None, int | None, int, int]
"""(most supervised tokens in one training row, longest row, rows, examples)."""


def row_stats_from_data(cfg: Config) -> RowStats:
    """The training rows' `RowStats` from the data (tokenizer only, no weights); (None, None,
    0, 0) when the data cannot be read.

    Raises:
        TokenizerMismatch: data.train is a prepared directory of another tokenizer.
    """

    d = cfg.data
    if d.train is None:
        return None, None, 0, 0
    try:
        # A run directory as model.path: the model and tokenizer train would start from.
        sources = start_sources(cfg.model.path, cfg.model.gguf_file)
        source = sources.model
        tok = load_tokenizer(sources.tokenizer)
        apply_chat_template(tok, d.chat_template)  # the template's tokens are in every row
        auto = d.max_seq_len == "auto"
        limit = (
            int(d.max_seq_len)
            if not auto
            else (model_context(source.location, source.gguf_file, cfg.model) or FALLBACK_CONTEXT)
        )
        pack = effective_pack(d.pack, cfg.method.name)
        if cfg.train.objective != SFT:
            return _preference_row_stats(cfg, tok, limit, pack)
        # Uncleaned and every line accepted; no cache directory (`plan` writes nothing). A
        # prepared directory's rows are used as they are, as `train` uses them.
        settings = PrepareSettings(
            d.format, limit, pack and not auto, d.system_prompt, d.system_message
        )
        data = prepared_data(d.train, settings=settings, tokenizer=tok, max_bad_fraction=1.0)
        # max_seq_len=auto packs up to the longest example, as `train` does.
        repack = auto and not Path(d.train).is_dir()
        rows = (
            rows_for(data.examples, pack, longest_example(data.examples)) if repack else data.rows
        )
    except TokenizerMismatch:  # planning another model's token ids would mislead: say so
        raise
    except Exception:
        # A plan without the data still answers: the planner then assumes full rows of
        # data.max_seq_len, all supervised, and the configured global batch.
        return None, None, 0, 0
    longest = max((len(r.input_ids) for r in rows), default=0) or None
    supervised = max_supervised_per_row([r.labels for r in rows])
    return supervised, longest, len(rows), len(data.examples)


def _preference_row_stats(
    cfg: Config, tok: PreTrainedTokenizerBase, limit: int, pack: bool
) -> RowStats:
    """`RowStats` of a preference run's rows, packed as `train` packs them (no cache written)."""
    d = with_objective_format(cfg).data  # data.format=chat (the default) reads the pairs
    assert d.train is not None
    data = preference_data(
        d.train,
        fmt=d.format,
        tokenizer=tok,
        max_seq_len=limit,
        system_prompt=d.system_prompt,
        system_message=d.system_message,
        max_bad_fraction=1.0,
    )
    seq_len = longest_sequence(data) if d.max_seq_len == "auto" else limit
    return preference_row_stats(preference_rows(data, seq_len, pack))


def preference_row_stats(rows: list[PreferenceRow]) -> RowStats:
    """`RowStats` of a preference run's packed rows."""
    longest = max((len(r.input_ids) for r in rows), default=0) or None
    supervised = max_supervised_per_row([r.labels for r in rows])
    # Sequences, not pairs: the examples `train`'s default global batch counts (its data holds
    # a pair's two answers as two).
    return supervised, longest, len(rows), sum(len(r.segments) for r in rows)


def plan(
    cfg: Config,
    device: str,
    budget: str | None = None,
    row_stats: RowStats | None = None,
    allocator: str = "glibc",
) -> dict[str, Any]:
    """Predict the configured run and recommend the fastest settings that fit the budget.

    `row_stats` is given when the caller has the rows already (`leantune inspect`); by default
    they are read from the data. The global batch is the one `train` takes on them.
    `allocator` is the CPU allocator `train` would run with (`core.allocator`).
    """
    supervised, longest, rows, examples = row_stats or row_stats_from_data(cfg)
    # The batch `train` takes: never more than the data's rows (`_batch_and_steps`).
    batch = min(resolved_global_batch(cfg.train, rows, examples), rows) if rows else None
    model = start_sources(cfg.model.path, cfg.model.gguf_file).model  # a run: as train reads it
    inputs = replace(plan_inputs(cfg), model_path=model.location, gguf_file=model.gguf_file)
    basis = plan_basis(inputs, device, supervised, longest, batch, allocator)
    limit = budget_for(inputs.memory_budget, device, budget)
    configured = estimate(basis.facts, basis.step, basis.weight_itemsize)
    best = recommend(
        alternatives(inputs, basis),
        cfg.method.name,
        basis.step,
        basis.global_batch,
        limit,
        basis.weight_itemsize,
        available_optimizers(device),
        lighter_weights(inputs, device, supervised, longest, batch, allocator),
    )
    return {
        "device": device,
        "allocator": allocator if device == "cpu" else None,
        "margin_of": margin_key(device, allocator, basis.step.weight_quant is not None),
        "budget": limit,
        "fits": configured.needed <= limit,
        "configured": {
            "method": cfg.method.name,
            "micro_batch": basis.step.micro_batch,
            "grad_accum": basis.global_batch // basis.step.micro_batch,
            "seq_len": basis.step.seq_len,
            "supervised_per_row": basis.step.supervised_per_row,
            "gradient_checkpointing": basis.step.gradient_checkpointing,
            "optimizer": basis.step.optimizer,
            "precision": basis.step.precision,
            "trainable_params": basis.facts.trainable_params,
            "total_params": basis.facts.total_params,
            "breakdown": configured.as_dict(),
        },
        "recommended": best.as_dict() if best is not None else None,
    }


def format_text(result: dict[str, Any]) -> str:
    """The plan as a readable table plus a verdict and a recommendation."""
    c = result["configured"]
    b = c["breakdown"]
    lines = [
        f"method {c['method']}: {c['trainable_params']:,} of {c['total_params']:,} parameters "
        f"train; micro-batch {c['micro_batch']} x grad_accum {c['grad_accum']}, seq_len "
        f"{c['seq_len']}, checkpointing {'on' if c['gradient_checkpointing'] else 'off'}, "
        f"optimizer {c['optimizer']}, precision {c['precision']}",
        "",
    ]
    for key, label in COMPONENTS:
        lines.append(f"  {label:40s} {b[key] / GIB:8.3f} GiB")
    lines.append(
        "  peak = runtime + weights + reference copy + optimizer"
        " + max(activations + max(loss, recompute, reference), gradients + step)"
    )
    lines.append(f"  {'predicted peak (live tensors)':40s} {b['peak'] / GIB:8.3f} GiB")
    if b["margin"] != 1:
        label = f"with the allocator's margin x{b['margin']:g}"
        lines.append(f"  {label:40s} {b['peak'] * b['margin'] / GIB:8.3f} GiB")
        lines.append(f"  ({MARGIN_MEASURED[result['margin_of']]}: estimate.FIT_MARGIN)")
    if b["load"]:
        lines.append(f"  {LOAD_LABEL:40s} {b['load'] / GIB:8.3f} GiB")
    if b["reference_pass"]:
        lines.append(f"  {REFERENCE_PASS_LABEL:40s} {b['reference_pass'] / GIB:8.3f} GiB")
    lines.append(f"  {'needed':40s} {b['needed'] / GIB:8.3f} GiB")
    budget = result["budget"] / GIB
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines += ["", f"{verdict} the {result['device']} budget of {budget:.2f} GiB"]
    rec = result["recommended"]
    if rec is None:
        lines.append(
            "nothing fits: shorten data.max_seq_len, or use a smaller model or more memory"
        )
    else:
        dtype = rec.get("model_dtype")
        lines.append(
            f"fastest that fits: method.name={rec['method']} "
            + (f"model.dtype={dtype} " if dtype else "")
            + f"train.micro_batch_size={rec['micro_batch']} train.grad_accum={rec['grad_accum']} "
            f"train.gradient_checkpointing={str(rec['gradient_checkpointing']).lower()}"
            + (f" train.optimizer={rec['optimizer']}" if rec["optimizer"] != "adamw" else "")
            + f" (needs {rec['breakdown']['needed'] / GIB:.3f} GiB)"
        )
    return "\n".join(lines)
