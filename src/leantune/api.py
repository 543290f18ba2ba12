"""The Python API: what `leantune train`, `eval` and `export` do, callable from Python.

    from leantune import load_config, train, evaluate
    cfg = load_config(None, ["data.train=my.jsonl", "data.format=chat", "run.name=mine"])
    summary = train(cfg)                      # runs/mine/: final/, metrics, checkpoints
    scores = evaluate("runs/mine", "held_out.jsonl")

Each call quiets the libraries as the CLI does: transformers logs errors only and shows no
progress bars, and the import-time warnings of torchao and torch's pytree (nothing a user can
act on) are not shown. Errors that are the user's to fix raise `leantune.errors.UserError`
subclasses whose message names the file, field or flag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from leantune.config import Config
from leantune.errors import UserError
from leantune.models.paths import check_model_path
from leantune.models.quiet import quiet_import_noise, quiet_libraries
from leantune.training.checks import load_config

Attention = Literal["auto", "segments", "sdpa", "eager"]
"""model.attn_implementation's choices (the library's own type lives with torch's imports)."""


def _quiet() -> None:
    """The CLI's warning hygiene (`models.quiet`, which the CLI calls too)."""
    quiet_import_noise()
    quiet_libraries()


def _silent(_: str) -> None:
    pass


def train(
    config: Config | str | Path | None = None,
    overrides: Sequence[str] = (),
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Run (or resume) a fine-tune, as `leantune train [CONFIG] [overrides]` does.

    Args:
        config: A Config (see `load_config`), a YAML file, or None: the built-in demo, unless
            `overrides` set data.train (then the library defaults, as on the command line).
        overrides: `section.key=value` strings over a YAML file or the demo (give them to
            `load_config` instead when passing a Config).
        log: Where progress lines go; None for none.

    Returns:
        The run summary, also written to the run directory.

    Raises:
        ConfigError: an invalid config or override, naming the field.
        UserError: bad data, or a run directory that is not this run's (exit code 2 in the CLI).
        TrainingHalted: the stability guard paused or stopped the run (`exit_code` 3 or 4), or
            one sequence does not fit in memory (5).
        Interrupted: SIGINT, SIGTERM or SIGHUP, after a checkpoint.
    """
    if isinstance(config, Config):
        # A Config was built (and checked) already; overrides set on it here would skip the
        # checks that load_config runs on the final values.
        if overrides:
            raise TypeError("train(): give overrides to load_config() when passing a Config")
        cfg, config_file = config, None
    else:
        cfg = load_config(config, list(overrides))
        config_file = Path(config) if config is not None else None
    _quiet()  # before the imports that log the noise
    # After `_quiet` (peft logs as it imports), and only here: `import leantune` stays light.
    from leantune.training.recipe import train as run

    # The recipe logs unconditionally: None becomes a function that drops the lines.
    return run(cfg, log=log or _silent, config_file=config_file)


def evaluate(
    model: str | Path,
    data: str | Path,
    format: str | None = None,
    limit: int | None = None,
    batch_size: int = 16,
    max_new_tokens: int | None = None,
    max_seq_len: int = 4096,
    dtype: str = "fp32",
    attn_implementation: Attention = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Loss, perplexity and exact match of a model on a JSONL file, as `leantune eval --data`.

    Args:
        model: A run directory (its final/), model or adapter directory, .gguf file, cached hub
            id or the demo name.
        data: The JSONL file.
        format: alpaca, chat or text; None detects it.
        limit: Evaluate the first `limit` examples only.
        batch_size: Examples per forward pass.
        max_new_tokens: Longest generated answer for exact match; None: the longest reference
            answer's tokens + max(16, 25%).
        max_seq_len: Longest example in tokens.
        dtype: fp32, bf16 or fp16 weights.
        attn_implementation: auto, segments, sdpa or eager (`leantune eval
            --attn-implementation`); auto is one the model supports.
        progress: Show the exact-match progress line (on stderr, when it is a terminal).

    Returns:
        The same object `leantune eval` prints.

    Raises:
        ModelPathError: `model` is not a model or cannot be loaded.
        UserError: `data` is not a file.
    """
    # Both checked before torch imports: a wrong path fails at once, not seconds later.
    check_model_path(str(model), "model")
    if not Path(data).is_file():
        raise UserError(f"data {data}: no such file; give a JSONL file")
    _quiet()  # before the imports that log the noise
    import torch

    # After `_quiet` (peft logs as it imports), and only here: `import leantune` stays light.
    from leantune.eval.run import evaluate_file
    from leantune.methods.artifacts import load_for_inference
    from leantune.monitor.metrics import GenerationBar

    torch.manual_seed(0)
    loaded, tokenizer = load_for_inference(
        str(model),
        dtype,
        attn_implementation=attn_implementation,
    )
    bar = GenerationBar("eval", enabled=progress)
    try:
        result = evaluate_file(
            loaded,
            tokenizer,
            Path(data),
            format,
            limit,
            batch_size,
            max_new_tokens,
            max_seq_len,
            on_progress=bar,
        )
    finally:
        bar.close()
    return {"model": str(model), **result}


def export_model(
    model: str | Path,
    format: str,
    out: str | Path,
    gguf_type: str = "f16",
    data: str | Path | None = None,
    samples: int = 4,
    attn_implementation: Attention = "auto",
) -> dict[str, Any]:
    """Export a run or model and check parity, as `leantune export`; returns the report.
    `attn_implementation` is its --attn-implementation (auto: one the model supports).

    Raises:
        ExportError: the format cannot be made from this input, or `out`/`data` are unusable.
        ModelPathError: `model` is not a model.
        ParityError: the written export does not reproduce the source (the report is written).
    """
    _quiet()  # before the imports that log the noise
    # After `_quiet` (peft logs as it imports), and only here: `import leantune` stays light.
    from leantune.export.run import export_model as run

    data_path = Path(data) if data else None  # None: the export's built-in parity prompts
    return run(
        str(model),
        format,
        Path(out),
        gguf_type,
        data_path,
        samples,
        attn_implementation,
    )
