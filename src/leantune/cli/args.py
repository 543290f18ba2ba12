"""What the command line's parsers share: argument types that name the flag in their errors,
the help formatters, the data path check, and the flags several commands take.

Nothing here imports torch or transformers: every command's parser is built from it for
`leantune --help`."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leantune.errors import UserError


def count(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]; argparse names the flag in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value

    return parse


def number(ok: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """An argparse type: a finite float for which `ok` holds (`rule` says which, e.g. ">= 0")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        # float() reads "nan" and "inf", and NaN would pass any range check.
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


def check_data_file(text: str, flag: str) -> Path:
    """The JSONL file given as `flag`, or a UserError naming the flag and the path."""
    path = Path(text)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a JSONL file")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file")
    return path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Options show their default: the value, or the help's own words for one that is not a
    plain value (`default: ...` in the help, e.g. "detected"). On/off flags are off unless given.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        # The help says its own default; a positional has none to show; an on/off flag
        # (nargs 0) would print "default: False".
        if "default" in text or not action.option_strings or action.nargs == 0:
            return text
        # None means "not given" (the config or the model decides), which "None" would not say.
        if action.default is None or action.default is argparse.SUPPRESS:
            return text
        return text + " (default: %(default)s)"


class RawEpilogHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the description and epilog kept as written (a table)."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; subcommand parsers are made of it too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # setdefault: a parser with a table in its epilog passes RawEpilogHelpFormatter.
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


MODEL_HELP = "model dir, run dir (its final/), adapter dir, .gguf file, cached hub id or demo name"


DTYPES = ("fp32", "bf16", "fp16")


CHAT_TEMPLATE_HELP = (
    "chatml, zephyr, llama3 or a Jinja file: the chat template to use instead of the "
    "tokenizer's (default: the tokenizer's own, as saved with the model)"
)


def add_attention_argument(p: argparse.ArgumentParser) -> None:
    """train's model.attn_implementation, for the commands that load a model to use it."""
    choices = ["auto", "segments", "sdpa", "eager"]
    about = "as train's model.attn_implementation; auto: sdpa, or eager where there is none"
    p.add_argument("--attn-implementation", choices=choices, default="auto", help=about)


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [section.key=value ...]`: the first argument without `=` is the config
    file, the rest are overrides."""
    config = None
    overrides = []
    for a in args:
        # An override always has '=', so a CONFIG whose file name holds one reads as an override.
        if "=" not in a and config is None:
            config = a
        else:
            overrides.append(a)
    return config, overrides


def runs(
    p: argparse.ArgumentParser,
    target: str,
    check: Callable[[argparse.Namespace], None] | None = None,
) -> None:
    """Declare what `p`'s command runs: `target`, a "module:function" that `app.main` imports
    only when the command runs, after `check` (the argument checks that need no model)."""
    p.set_defaults(run=target, check=check)
