"""The parity check every export ends with: the exported artefact, reloaded from disk, against the
source model on a few held-out samples.

It measures the largest absolute logit difference and the perplexity of each side over every
next-token position, compares them with per-format thresholds and writes `export_report.json`.
A failed check raises `ParityError`: an export that does not reproduce its source is an error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.core.writes import write_file
from leantune.data.chat_spans import render_conversation
from leantune.data.formats import FORMATS, detect_format, read_jsonl

REPORT_NAME = "export_report.json"

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""Maps input ids `[batch, seq]` to logits `[batch, seq, vocab]` (float32)."""

# Short conversations and a plain sentence, used when no held-out file is given: they exercise
# the chat template's special tokens and ordinary text.
BUILTIN_CONVERSATIONS: tuple[tuple[dict[str, str], ...], ...] = (
    (
        {"role": "user", "content": "Where is my order A-1234? It has not arrived yet."},
        {"role": "assistant", "content": '{"intent": "refund", "order_id": "A-1234"}'},
    ),
    (
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Translate to French: cat."},
        {"role": "assistant", "content": "chat"},
    ),
    ({"role": "user", "content": "Hello! How are you today?"},),
)
BUILTIN_TEXTS: tuple[str, ...] = ("The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5",)


class ParityError(RuntimeError):
    """The exported model does not reproduce the source within the format's thresholds."""


@dataclass(frozen=True)
class Thresholds:
    """Largest accepted differences between an export and its source."""

    max_abs_logit_diff: float
    """Largest absolute difference of any logit at any position."""
    max_ppl_rel_change: float
    """Largest relative change of perplexity, |ppl_export - ppl_source| / ppl_source."""


@dataclass(frozen=True)
class Samples:
    """Held-out texts and their token ids under the source tokenizer."""

    texts: list[str]
    ids: list[list[int]]


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], where: str = ""
) -> str:
    """The conversation as the template writes it (a refusal names `where`: `--data F:L: `);
    its texts one per line for a model without a template."""
    if getattr(tokenizer, "chat_template", None):
        return render_conversation(tokenizer, list(messages), where=where)
    return "\n".join(m["content"] for m in messages)


def build_samples(
    tokenizer: PreTrainedTokenizerBase,
    data: Path | None = None,
    count: int = 4,
    max_tokens: int = 128,
) -> Samples:
    """The first `count` valid records of `data` (or the built-in prompts), rendered and tokenised.

    Raises:
        FileNotFoundError: `data` does not exist.
        ValueError: `data` holds no valid record.
        ConversationRefused: the chat template refuses one of the records (exit 2).
    """
    if data is not None:
        if not data.is_file():
            raise FileNotFoundError(f"--data {data}: no such file")
        fmt = detect_format(data)
        assert fmt in FORMATS
        records, _ = read_jsonl(data, fmt)
        texts = [
            _render(tokenizer, r.messages, f"--data {r.source}:{r.line}: ")
            if r.messages is not None
            else str(r.text)
            for r in records[:count]
        ]
        if not texts:
            raise ValueError(f"--data {data}: no valid {fmt} record to check parity on")
    else:
        texts = [_render(tokenizer, c) for c in BUILTIN_CONVERSATIONS] + list(BUILTIN_TEXTS)
    ids = [list(tokenizer(t, add_special_tokens=True)["input_ids"])[:max_tokens] for t in texts]
    # A one-token sample has no next-token position for the perplexity.
    kept = [(t, i) for t, i in zip(texts, ids, strict=True) if len(i) >= 2]
    return Samples([t for t, _ in kept], [i for _, i in kept])


@torch.no_grad()
def sample_logits(fn: LogitsFn, samples: Samples) -> list[torch.Tensor]:
    """Logits of each sample alone, then of the first two as one batch (cut to equal length), so
    the check also covers a batch size and lengths other than any example input."""
    # float32 whatever the artefact computes in, so the differences are of values, not dtypes.
    out = [fn(torch.tensor([ids])).float()[0] for ids in samples.ids]
    if len(samples.ids) >= 2:
        # Cut, not padded: a LogitsFn takes no attention mask.
        n = min(len(samples.ids[0]), len(samples.ids[1]))
        batch = torch.tensor([samples.ids[0][:n], samples.ids[1][:n]])
        out.extend(fn(batch).float().unbind(0))
    return out


# The ids matching `sample_logits`'s outputs, its two-row batch included.
def _ids_for(samples: Samples) -> list[list[int]]:
    ids = list(samples.ids)
    if len(ids) >= 2:
        n = min(len(ids[0]), len(ids[1]))
        ids += [ids[0][:n], ids[1][:n]]
    return ids


def perplexity(logits: Sequence[torch.Tensor], ids: Sequence[list[int]]) -> float:
    """Perplexity over every next-token position of all samples."""
    total, count = 0.0, 0
    for lg, row in zip(logits, ids, strict=True):
        target = torch.tensor(row[1:])
        total += float(F.cross_entropy(lg[:-1], target, reduction="sum"))
        count += len(row) - 1
    # math.exp overflows past ~709; the cap keeps a broken export's perplexity finite.
    return math.exp(min(total / max(1, count), 50.0))


def compare(
    reference: Sequence[torch.Tensor], exported: Sequence[torch.Tensor], samples: Samples
) -> dict[str, float]:
    """Largest absolute logit difference and both perplexities.

    Raises:
        ParityError: the shapes differ (for example a wrong vocabulary size).
    """
    diff = 0.0
    for r, e in zip(reference, exported, strict=True):
        if r.shape != e.shape:
            raise ParityError(
                f"exported logits have shape {tuple(e.shape)}, source {tuple(r.shape)}"
            )
        d = (r - e).abs().max()
        # NaN compares false with everything, so max() would drop it and a NaN export would
        # pass: a non-finite difference counts as infinite.
        diff = max(diff, float(d) if torch.isfinite(d) else math.inf)
    ids = _ids_for(samples)
    ppl_src, ppl_exp = perplexity(reference, ids), perplexity(exported, ids)
    return {
        "max_abs_logit_diff": diff,
        "ppl_source": ppl_src,
        "ppl_export": ppl_exp,
        "ppl_rel_change": abs(ppl_exp - ppl_src) / ppl_src,
    }


def check_and_report(
    out_dir: Path,
    metrics: dict[str, float],
    thresholds: Thresholds,
    info: dict[str, Any],
    extra_failures: Sequence[str] = (),
    shown: Path | None = None,
) -> dict[str, Any]:
    """Write `export_report.json` and raise when a metric is over its threshold.

    Args:
        out_dir: the export directory.
        metrics: output of `compare`; empty when the export could not be read back, which
            `extra_failures` then says.
        thresholds: this format's limits.
        info: what was exported (format, source, samples, per-format measurements).
        extra_failures: failures found by a format's own checks (e.g. tokenizer mismatch).
        shown: the directory the message names, when `out_dir` is a temporary stand-in for it.

    Returns:
        The report as written.

    Raises:
        ParityError: a threshold is exceeded or `extra_failures` is not empty.
    """
    failures = list(extra_failures)
    # Neither would write a passing report for an export nobody checked.
    if not metrics and not failures:
        raise ValueError("check_and_report: no metrics and no failure to report")
    # `not x <= limit` rather than `x > limit`: a NaN metric fails.
    if metrics and not metrics["max_abs_logit_diff"] <= thresholds.max_abs_logit_diff:
        failures.append(
            f"max abs logit difference {metrics['max_abs_logit_diff']:.3g} > "
            f"{thresholds.max_abs_logit_diff:g}"
        )
    if metrics and not metrics["ppl_rel_change"] <= thresholds.max_ppl_rel_change:
        failures.append(
            f"perplexity {metrics['ppl_export']:.4g} vs source {metrics['ppl_source']:.4g} "
            f"(relative change {metrics['ppl_rel_change']:.3g} > {thresholds.max_ppl_rel_change:g})"
        )
    report = {
        **info,
        "parity": metrics,
        "thresholds": asdict(thresholds),
        "passed": not failures,
        "failures": failures,
    }
    write_file(out_dir / REPORT_NAME, json.dumps(report, indent=2) + "\n")
    if failures:
        named = shown or out_dir
        raise ParityError(
            f"{named}: export parity check failed ({'; '.join(failures)}); "
            f"see {named / REPORT_NAME}"
        )
    return report
