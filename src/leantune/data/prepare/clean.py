"""Clean text in one pass per record: HTML, control and zero-width characters, NFKC, whitespace.

Every rule can be switched off. Only tags that HTML defines are removed: text that merely
contains `<` or `&` ("a < b & c", "x<y and y>z", "AT&T") comes out unchanged.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from html.parser import HTMLParser
from typing import Any

# The order the rules run in: HTML first, since decoded entities (&nbsp;, &#8203;) produce
# the characters the later rules normalise; whitespace last, to collapse what the others leave.
RULES = ("html", "control", "nfkc", "whitespace")

# Elements defined by HTML (WHATWG living standard plus common obsolete ones). A "tag" with any
# other name (`<y and y>` in "x<y and y>z") is prose, so it is kept verbatim.
HTML_ELEMENTS = frozenset(
    """a abbr acronym address area article aside audio b base basefont bdi bdo big blink
    blockquote body br button canvas caption center cite code col colgroup data datalist dd del
    details dfn dialog dir div dl dt em embed fieldset figcaption figure font footer form frame
    frameset h1 h2 h3 h4 h5 h6 head header hgroup hr html i iframe img input ins kbd label legend
    li link main map mark marquee menu meta meter nav nobr noframes noscript object ol optgroup
    option output p param picture pre progress q rp rt ruby s samp script search section select
    slot small source span strike strong style sub summary sup svg table tbody td template
    textarea tfoot th thead time title tr track tt u ul var video wbr""".split()  # noqa: SIM905
)
# Tags after which a line break keeps words of neighbouring blocks apart.
BLOCK_ELEMENTS = frozenset(
    """address article aside blockquote br dd details div dl dt fieldset figcaption figure
    footer form h1 h2 h3 h4 h5 h6 header hr li main nav ol p pre section summary table tbody td
    tfoot th thead tr ul""".split()  # noqa: SIM905
)
# Elements whose content is code or markup, not text a reader sees: dropped with their tags.
DROP_CONTENT = frozenset({"script", "style", "noscript", "template"})

# `&` that does not start a complete reference (`&amp;`, `&#169;`, `&#xA9;`) is literal text;
# escaping it first stops html.unescape from reading "&copy 2024" or "?a=1&para=2" as entities.
_BARE_AMP = re.compile(r"&(?!#[0-9]{1,7};|#[xX][0-9a-fA-F]{1,6};|[A-Za-z][A-Za-z0-9]{1,31};)")

# C0/C1 controls except tab and newline, plus invisible format characters that are noise in
# training text. ZWJ (U+200D) and ZWNJ (U+200C) stay: emoji sequences and Persian/Indic
# scripts need them.
_INVISIBLE = [0x00AD, 0x180E, 0x200B, 0x200E, 0x200F, 0x2060, 0xFEFF]
_INVISIBLE += list(range(0x202A, 0x202F)) + list(range(0x2066, 0x206A))
_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f" + "".join(f"\\u{c:04x}" for c in _INVISIBLE) + "]"
)
_BLANK_LINES = re.compile(r"\n{3,}")


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0  # a depth, not a flag: <script> inside <noscript> must not end early

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in HTML_ELEMENTS:
            self.parts.append(self.get_starttag_text() or "")
        elif tag in DROP_CONTENT:
            self._skip += 1
        elif tag in BLOCK_ELEMENTS:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in HTML_ELEMENTS:
            self.parts.append(self.get_starttag_text() or "")
        elif tag in BLOCK_ELEMENTS:
            self.parts.append("\n")

    def parse_marked_section(self, i: int, report: bool = True) -> int:
        # html.parser raises AssertionError on "<![" followed by anything but the keywords it
        # knows (CDATA, if, ...): such text is not markup, so it stays as text.
        try:
            return super().parse_marked_section(i, report)
        except AssertionError:
            self.handle_data("<![")
            return i + 3

    def handle_endtag(self, tag: str) -> None:
        if tag not in HTML_ELEMENTS:
            self.parts.append(f"</{tag}>")
        elif tag in DROP_CONTENT:
            self._skip = max(0, self._skip - 1)
        elif tag in BLOCK_ELEMENTS:
            self.parts.append("\n")


def strip_html(text: str) -> str:
    """Remove HTML tags, comments and script/style content; decode entities."""
    # Most records hold no markup at all: skip the parser for them.
    if "<" not in text and "&" not in text:
        return text
    # The stdlib parser (a real tokenizer, not a regex) copes with quoted attributes that hold
    # '>', comments and CDATA, which a regex gets wrong.
    parser = _TextExtractor()
    parser.feed(_BARE_AMP.sub("&amp;", text))
    parser.close()
    return "".join(parser.parts)


def strip_control(text: str) -> str:
    """Drop control and zero-width characters; CRLF and CR become LF."""
    # Line ends first: \r is a control character and would otherwise be deleted, gluing the
    # lines of an old Mac file together.
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub("", text) if _CONTROL.search(text) else text


def nfkc(text: str) -> str:
    """NFKC normalisation (full-width forms, ligatures, NBSP); every script is kept."""
    # ASCII is always NFKC; is_normalized is a quick check that avoids a copy of the text.
    if text.isascii() or unicodedata.is_normalized("NFKC", text):
        return text
    return unicodedata.normalize("NFKC", text)


def normalize_whitespace(text: str) -> str:
    """Collapse runs of spaces between words, strip line ends, keep at most one blank line.

    Leading indentation is kept (code in answers needs it).
    """
    lines = []
    for line in text.split("\n"):
        body = line.lstrip()
        # split() with no argument also drops trailing whitespace.
        lines.append(line[: len(line) - len(body)] + " ".join(body.split()) if body else "")
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


_RULE_FUNCS = {
    "html": strip_html,
    "control": strip_control,
    "nfkc": nfkc,
    "whitespace": normalize_whitespace,
}


def check_rules(rules: Iterable[str]) -> tuple[str, ...]:
    """Validate rule names; returns them in the order they run (the order of RULES).

    Raises:
        ValueError: an unknown rule, naming the valid ones.
    """
    # Returned in RULES order whatever order they were given in: the order matters for the
    # output, and a canonical tuple keeps the cache key the same for the same set.
    rules = tuple(rules)
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        raise ValueError(f"unknown cleaning rule(s) {unknown}; valid: {', '.join(RULES)}")
    return tuple(r for r in RULES if r in rules)


def clean_text(text: str, rules: tuple[str, ...], changed: dict[str, int] | None = None) -> str:
    """Apply `rules` (already validated and ordered) to one string.

    Args:
        changed: when given, `changed[rule]` is incremented for every rule that altered the text.
    """
    for rule in rules:
        out = _RULE_FUNCS[rule](text)
        if changed is not None and out != text:
            changed[rule] = changed.get(rule, 0) + 1
        text = out
    return text


def clean_record(
    parsed: dict[str, Any], rules: tuple[str, ...], changed: dict[str, int] | None = None
) -> dict[str, Any]:
    """Clean every text field of a parsed record (`{"messages": [...]}` or `{"text": ...}`)."""
    if not rules:
        return parsed
    if "text" in parsed:
        return {"text": clean_text(parsed["text"], rules, changed)}
    # Every key but the messages (e.g. prompt/completion's supervise_from) is kept as is.
    messages = [
        {**m, "content": clean_text(m["content"], rules, changed)} for m in parsed["messages"]
    ]
    return {**parsed, "messages": messages}
