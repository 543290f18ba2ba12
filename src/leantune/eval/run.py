"""`evaluate_file`: loss, perplexity and exact match of a loaded model on a JSONL file.

What `leantune eval --data` computes, without the command line: the CLI and the Python API
(`leantune.evaluate`) both call it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from peft import PeftModel
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.dataset import check_token_range, prepared_data
from leantune.data.errors import DataError
from leantune.data.formats import detect_format
from leantune.data.preference_formats import detect_preference_format
from leantune.data.prepare.records import PrepareSettings
from leantune.eval.exact_match import evaluate_exact_match
from leantune.eval.perplexity import evaluate_loss
from leantune.eval.preference import evaluate_preference
from leantune.eval.progress import ProgressCallback


def evaluate_file(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    fmt: str | None = None,
    limit: int | None = None,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    max_seq_len: int = 4096,
    on_bad_line: Callable[[str], None] | None = None,
    on_progress: ProgressCallback | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Evaluate `model` on the JSONL file `path`.

    Args:
        model: A causal LM (plain or peft), in eval mode.
        tokenizer: Its tokenizer.
        path: The JSONL file.
        fmt: Its record format; None detects it.
        limit: Evaluate only the first `limit` examples (None: all).
        batch_size: Examples per forward pass and per generate call.
        max_new_tokens: Longest generated answer for exact match; None: the longest reference
            answer plus a margin (`exact_match.answer_token_cap`).
        max_seq_len: Longest example in tokens; longer ones count as bad lines.
        on_bad_line: Called with each bad line's description (file, line, reason).
        on_progress: Called as exact match generates (`generate_texts`), e.g. a progress bar.
        log: Told the exact-match cap when it comes from the references.

    Returns:
        `data`, `format`, the loss and perplexity keys of `evaluate_loss`, `examples`,
        `bad_lines`, and `exact_match` (greedy) for records with conversations. Preference
        pairs (detected) instead: `pairs`, `preference_accuracy`, `mean_margin`, `bad_lines`.

    Raises:
        DataError: unpaired (KTO) data, which has no preference accuracy.
    """
    # An explicit fmt is a non-preference format: only auto-detection routes to the pair scorer.
    found = detect_preference_format(path) if fmt is None else None
    if found == "preference":
        return evaluate_preference(
            model, tokenizer, path, limit, batch_size, max_seq_len, on_bad_line
        )
    if found == "kto":
        raise DataError(
            f"{path}: unpaired (KTO) records (prompt, completion, label) have no preference "
            "accuracy; eval scores pairs (prompt, chosen, rejected), or give --format "
            "prompt_completion for the completions' loss"
        )
    fmt = fmt or detect_format(path)
    # Every line is scored or reported, none refused; one example per row, uncleaned.
    data = prepared_data(
        path,
        settings=PrepareSettings(fmt, max_seq_len, pack=False),
        tokenizer=tokenizer,
        max_bad_fraction=1.0,
    )
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if isinstance(rows, int):  # ids past the embedding: exit 2, not an IndexError mid-batch
        check_token_range(data, rows, path)
    for bad in data.bad:
        if on_bad_line is not None:
            on_bad_line(str(bad))
    # The limit applies after preparation, so bad_lines counts the whole file's bad lines.
    if limit is not None:
        data.rows, data.records = data.rows[:limit], data.records[:limit]
    result: dict[str, Any] = {"data": str(path), "format": fmt}
    result.update(evaluate_loss(model, data.rows, int(tokenizer.pad_token_id), batch_size))
    result["examples"] = len(data.rows)
    result["bad_lines"] = len(data.bad)
    # Only chat records carry a reference assistant turn to compare a generated answer with.
    conversations = [list(r.messages) for r in data.records if r.messages is not None]
    if conversations:
        score, _ = evaluate_exact_match(
            model, tokenizer, conversations, batch_size, max_new_tokens, on_progress, log
        )
        result["exact_match"] = score
    return result
