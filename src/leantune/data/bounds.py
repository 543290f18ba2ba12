"""A lower bound on a text's token count, from its length alone, to reject over-long records
before tokenising them (one 50 MB line took 130 s and 12.8 GB to tokenise only to be dropped).

For a BPE tokenizer with no unknown token (byte-level pre-tokenisation, or byte fallback), the
tokens of a text partition its normalised form, and no token covers more bytes than the
longest one in the vocabulary, L (added tokens included). So a text of B normalised bytes has
at least ceil(B / L) tokens. `token_floor` offers the bound only when every step of the
tokenizer keeps this true (see `_build`); any other tokenizer gets no bound, and its records
are tokenised.
"""

from __future__ import annotations

import contextlib
import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Normalisers that work character by character: normalising the whole text then gives no more
# bytes than the pieces the tokenizer really normalises between its added tokens.
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Sequence"}
# Pre-tokenisers that split without removing anything.
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Sequence"}
_MAX_GROWTH = 18  # NFKC/NFKD turn one character into at most 18 (U+FDFA)
_SPACE = re.compile(r"\s+")  # a superset of what an added token's lstrip/rstrip absorbs

# Weak keys: the cache must not keep a tokenizer (and its vocabulary) alive after its run.
_FLOORS: weakref.WeakKeyDictionary[Any, TokenFloor | None] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TokenFloor:
    """At least how many tokens a text becomes, computed without tokenising it."""

    max_token_bytes: int
    normalize: Callable[[str], str] | None = None
    count_spaces: bool = True
    prepended: int = 0  # bytes a `Prepend` normaliser adds once to the whole text
    dropped: bytes = b""  # bytes with no token of their own, which a byte-level BPE skips

    def at_least(self, text: str) -> int:
        """A number of tokens that `text` (without special tokens added) has at least."""
        try:
            if self.normalize is not None:
                text = self.normalize(text)
            if not self.count_spaces:
                text = _SPACE.sub("", text)
            data = text.encode("utf-8")
            size = len(data.translate(None, self.dropped) if self.dropped else data)
            # The marker is not the text's own: leaving it out keeps the bound a lower one.
            size -= self.prepended
        except (UnicodeEncodeError, TypeError, ValueError):  # not text the tokenizer takes
            return 0
        return max(0, -(-size // self.max_token_bytes))  # ceil division on ints

    def exceeds(self, text: str, limit: int) -> int | None:
        """The bound when it is above `limit` (the text is certainly too long), else None."""
        growth = 1 if self.normalize is None else _MAX_GROWTH
        if len(text) * 4 * growth <= limit * self.max_token_bytes:
            return None  # at most 4 bytes a character: the bound cannot be above the limit
        n = self.at_least(text)
        return n if n > limit else None


def token_floor(tokenizer: Any) -> TokenFloor | None:
    """The token floor of `tokenizer`, or None where no such bound holds (cached per object)."""
    try:
        return _FLOORS[tokenizer]
    except (KeyError, TypeError):
        pass
    floor = _build(tokenizer)
    with contextlib.suppress(TypeError):  # not weak-referenceable: computed again next time
        _FLOORS[tokenizer] = floor
    return floor


def _types(node: Any, key: str) -> list[dict[str, Any]]:
    """The steps of a (possibly nested `Sequence`) normaliser or pre-tokeniser."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [step for child in node.get(key, []) for step in _types(child, key)]
    return [node]


def _char_local_normalizer(steps: list[dict[str, Any]]) -> bool:
    for step in steps:
        if step.get("type") not in _NORMALIZERS:
            return False
        if step["type"] == "Replace":
            pattern = step.get("pattern", {})
            if len(pattern.get("String", "")) != 1:  # a regex or a multi-character pattern
                return False
    return True


def _build(tokenizer: Any) -> TokenFloor | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    # Only BPE: the argument above (pieces partition the text, no unknown token) is checked
    # against BPE's options alone.
    pre = _types(spec.get("pre_tokenizer"), "pretokenizers")
    norm = _types(spec.get("normalizer"), "normalizers")
    if model.get("type") != "BPE" or not _char_local_normalizer(norm):
        return None
    if any(p.get("type") not in _PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre):
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    vocab = model.get("vocab") or {}
    dropped = b""
    if byte_level:
        missing = bytes(b for b, c in _byte_chars().items() if c not in vocab)
        if missing and model.get("unk_token") is not None and model.get("fuse_unk"):
            return None  # one unknown token for a run of them: any length
        if model.get("unk_token") is None:
            dropped = missing  # skipped: they make no token at all
    elif not model.get("byte_fallback") or any(f"<0x{b:02X}>" not in vocab for b in range(256)):
        return None  # an unknown token could stand for any length of text
    # A byte-level piece's characters are one input byte each; other pieces are measured in
    # UTF-8, which can only overstate what they cover (a "▁" stands for one space).
    sizes = [len(p) if byte_level else len(p.encode("utf-8")) for p in vocab]
    normalize = backend.normalizer.normalize_str if spec.get("normalizer") else None
    prepended = sum(len(n["prepend"].encode("utf-8")) for n in norm if n["type"] == "Prepend")
    count_spaces = True
    for added in spec.get("added_tokens") or []:
        content = added.get("content", "")
        sizes.append(len(content.encode("utf-8")))  # an added token can be the longest piece
        # A token that absorbs the whitespace beside it covers more bytes than its content:
        # spaces are then not counted at all.
        if added.get("lstrip") or added.get("rstrip"):
            count_spaces = False
        if normalize is not None and not added.get("normalized", False):
            # Matched before normalisation: normalising it with the whole text must not grow it.
            grown = len(normalize(content).encode("utf-8")) - prepended
            if grown > len(content.encode("utf-8")):
                return None
    longest = max(sizes, default=0)
    if longest <= 0:
        return None
    return TokenFloor(longest, normalize, count_spaces, prepended, dropped)


def _byte_chars() -> dict[int, str]:
    """The byte-level alphabet (GPT-2's `bytes_to_unicode`): byte -> the character for it."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in chars)
    chars.update({b: chr(0x100 + n) for n, b in enumerate(extra)})
    return chars
