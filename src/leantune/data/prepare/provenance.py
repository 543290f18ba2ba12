"""Which tokenizer made a prepared directory, and the check that a model's tokenizer is that one.

`prepare_dataset` records the `TokenizerDigest` of its tokenizer in prepare_report.json
(``tokenizer_digest``, beside ``tokenizer``, where it was loaded from), and `check_tokenizer`
refuses a model whose tokenizer has another one. `tokenizer_digest` is the one definition of a
tokenizer's identity, which the tokenise-once cache key hashes too (`tokenizer_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.data.errors import DataError

DIGEST_KEY = "tokenizer_digest"
"""The prepare_report.json key that holds the `TokenizerDigest` as a dict."""


class TokenizerMismatch(DataError):
    """A prepared directory is read with a tokenizer other than the one that made it."""


@dataclass(frozen=True)
class TokenizerDigest:
    """sha256 digests of what decides a record's token ids."""

    ids: str
    """The tokenizer: its class, model (vocabulary, merges), normalizer, pre-tokenizer,
    post-processor, added and special tokens."""
    chat_template: str
    """The chat template conversations are rendered with (the digest of null when none)."""


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> TokenizerDigest:
    """The digest of `tokenizer` as it is now (its chat template included)."""
    # The class is part of it: a slow and a fast tokenizer of one vocabulary can tokenise
    # differently.
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
        if backend.truncation is not None or backend.padding is not None:
            # Settings the backend keeps from its last call (`tokenizer(..., padding=True)`
            # sets them): the same tokenizer after a padded call must have the same digest.
            # A copy without them, so the caller's tokenizer is left as it is.
            bare = Tokenizer.from_str(text)
            bare.no_truncation()
            bare.no_padding()
            text = bare.to_str()
        h.update(text.encode())
    else:
        # A slow tokenizer has no serialised form: its vocabulary (sorted, so the digest does
        # not depend on dict order) and, where it has one, its SentencePiece model.
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        sp_model = getattr(tokenizer, "sp_model", None)  # a slow SentencePiece tokenizer
        if sp_model is not None and hasattr(sp_model, "serialized_model_proto"):
            h.update(sp_model.serialized_model_proto())
    # The special tokens and their ids decide what the template renders and the EOS appended
    # to text records, and can be changed without touching the backend.
    specials = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    h.update(json.dumps([specials, tokenizer.eos_token_id, tokenizer.bos_token_id]).encode())
    template = getattr(tokenizer, "chat_template", None)
    rendered = hashlib.sha256(json.dumps(template, sort_keys=True).encode())
    return TokenizerDigest(ids=h.hexdigest(), chat_template=rendered.hexdigest())


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """One hex digest of `tokenizer_digest` (tokenizer and chat template): the cache key's."""
    parts = json.dumps(asdict(tokenizer_digest(tokenizer)), sort_keys=True)
    return hashlib.sha256(parts.encode()).hexdigest()


def recorded_digest(report: dict[str, Any]) -> TokenizerDigest | None:
    """The digest a prepared directory's report records (None before it was recorded)."""
    raw = report.get(DIGEST_KEY)
    if not isinstance(raw, dict):
        return None
    ids, template = raw.get("ids"), raw.get("chat_template")
    if not isinstance(ids, str) or not isinstance(template, str):
        return None
    return TokenizerDigest(ids, template)


def check_tokenizer(
    out: Path, report: dict[str, Any], tokenizer: PreTrainedTokenizerBase, fmt: str
) -> None:
    """Refuse to read the prepared directory `out` (its `report`) with `tokenizer`, the model's,
    unless the tokenizer that made it was the same; its chat template counts unless `fmt` is
    text.

    Raises:
        TokenizerMismatch: naming the directory and its tokenizer, the model and its tokenizer,
            and how to prepare the directory again.
    """
    made_with = str(report.get("tokenizer") or "an unrecorded tokenizer")
    model = str(getattr(tokenizer, "name_or_path", "") or "the model")
    recorded = recorded_digest(report)
    # Ids mean text only to the tokenizer that made them: with another vocabulary of the same
    # size they train the model on other text without a sound, with a smaller one they index
    # past its embedding. So a directory that does not say which tokenizer made it is refused.
    if recorded is None:
        again = _prepare_again(out, report, model)
        raise TokenizerMismatch(
            f"{out}: prepared (with the tokenizer of {made_with}) by a leantune that did not "
            f"record which tokenizer made its token ids, so they cannot be checked against the "
            f"tokenizer of model.path {model}; prepare it again: {again}"
        )
    current = tokenizer_digest(tokenizer)
    ids_differ = recorded.ids != current.ids
    # Plain text is never rendered through a template, so its template cannot matter.
    template_differs = fmt != "text" and recorded.chat_template != current.chat_template
    if not ids_differ and not template_differs:
        return
    what = " and ".join(
        name
        for name, differs in (("tokenizers", ids_differ), ("chat templates", template_differs))
        if differs
    )
    if ids_differ:
        fix = (
            f"Prepare it again with this model ({_prepare_again(out, report, model)}), or set "
            f"model.path to the model it was prepared with ({made_with})"
        )
    else:  # the same tokenizer: only data.chat_template (or the model's own template) moved
        fix = (
            "Use the chat template it was prepared with (data.chat_template, or the model's own "
            "template when unset), or prepare it again with this run's (add --chat-template as "
            f"data.chat_template to: {_prepare_again(out, report, model)})"
        )
    raise TokenizerMismatch(
        f"{out}: prepared with the tokenizer of {made_with} ({_describe(recorded)}), but "
        f"model.path {model} has {_describe(current)}: the {what} differ, so its token ids "
        f"would train this model on other text than the data's. {fix}"
    )


def _describe(digest: TokenizerDigest) -> str:
    return f"tokenizer {digest.ids[:12]}, chat template {digest.chat_template[:12]}"


def _prepare_again(out: Path, report: dict[str, Any], model: str) -> str:
    """The `leantune prepare` command line that rebuilds `out` from its recorded inputs."""
    files = " ".join(str(f) for f in report.get("files") or []) or "FILE..."
    settings = report.get("settings") or {}
    fmt, length = settings.get("format") or "FORMAT", settings.get("max_seq_len")
    flags = f" --max-seq-len {length}" if isinstance(length, int) else ""
    return f"leantune prepare --data {files} --format {fmt}{flags} --model {model} --out {out}"
