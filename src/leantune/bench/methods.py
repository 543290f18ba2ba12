"""`leantune bench methods`: the same model, data and steps under every method, side by side.

Each method trains in its own `leantune train` subprocess, so its peak RSS is its own and one
method's failure is a row of the table, not the end of the benchmark. Before the first run, every
method's config is checked as its run will check it (`refusals`): a method whose optional package
is missing (qlora without the `lowbit` extra) is skipped with its install line, and one whose
settings are refused fails at once, not after the methods before it have trained. The numbers
come from each run's own summary.json and metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from leantune.config.parse import ConfigError, MissingPackage
from leantune.core.writes import write_file
from leantune.layout import RunPaths
from leantune.monitor.metrics import read_metrics
from leantune.monitor.summary import finished_summary
from leantune.training.checks import load_config

Log = Callable[[str], None]

TABLE_FILE, JSON_FILE, PLOT_FILE = "methods.md", "methods.json", "methods.png"
"""What `write_outputs` writes into the benchmark's --out folder."""
BASELINE = "full"
"""The method every other one is compared with (retention)."""


@dataclass
class MethodResult:
    """One method's row of the benchmark."""

    method: str
    lr: float
    status: str  # "ok", "failed" or "skipped" (an optional package is missing; never ran)
    trainable_params: int | None = None
    total_params: int | None = None
    trainable_pct: float | None = None
    peak_rss_gib: float | None = None
    tokens_per_s: float | None = None
    train_time_s: float | None = None
    examples_seen: int | None = None
    eval_loss: float | None = None
    exact_match: float | None = None
    retention: float | None = None
    """Exact match as a share of full fine-tuning's."""
    loss_retention: float | None = None
    """The held-out loss reduction from the base model as a share of full fine-tuning's:
    (base - method) / (base - full)."""
    error: str | None = None
    exit_code: int | None = None
    """A failed run's `leantune train` exit code (2: refused, the user's to fix)."""
    install: str | None = None
    """A skipped method's install line: what installs the package it needs."""


def base_loss_command(
    config_model: str, eval_file: str, fmt: str, limit: int | None, max_seq_len: int | str
) -> list[str]:
    """`leantune eval` of the untrained base model on the held-out file, for its loss."""
    cmd = [sys.executable, "-m", "leantune", "eval", "--model", config_model, "--data", eval_file]
    # One new token: only the loss is used here; the first run measures the base model's exact
    # match (train.eval_base).
    cmd += ["--format", fmt, "--max-new-tokens", "1"]
    cmd += ["--limit", str(limit)] if limit is not None else []
    return cmd + (["--max-seq-len", str(max_seq_len)] if isinstance(max_seq_len, int) else [])


def base_eval_loss(cmd: list[str], log_file: Path) -> float | None:
    """Run `base_loss_command`; the loss it prints, or None when it failed."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return None
    # The JSON result is printed last; whatever precedes it on stdout is skipped.
    start = proc.stdout.find("{")
    try:
        loss = json.loads(proc.stdout[start:]).get("loss") if start >= 0 else None
    except json.JSONDecodeError:
        return None
    return float(loss) if isinstance(loss, (int, float)) else None


def run_overrides(
    method: str, lr: float, run_dir: Path, overrides: list[str], base: bool
) -> list[str]:
    """The overrides of one method's run: the benchmark's, then the method, rate and folder."""
    # After the benchmark's own overrides, so that these win (the last setting applies).
    return [
        *overrides,
        f"method.name={method}",
        f"train.lr={lr!r}",  # repr: the exact rate, not a rounded one
        f"run.dir={run_dir}",
        "run.resume=never",  # each row trains from scratch (an old run there is moved aside)
        "run.progress=false",
        f"train.eval_base={str(base).lower()}",
    ]


def train_command(
    config: str | None, method: str, lr: float, run_dir: Path, overrides: list[str], base: bool
) -> list[str]:
    """The `leantune train` command line for one method's run."""
    cmd = [sys.executable, "-m", "leantune", "train"]
    if config is not None:
        cmd.append(config)
    return [*cmd, *run_overrides(method, lr, run_dir, overrides, base)]


def run_logged(cmd: list[str], log_file: Path) -> tuple[int, str | None]:
    """Run one `leantune train` subprocess, its output into `log_file`; its exit code, and
    None when it succeeded, else the reason (its last stderr line)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.write_text(proc.stdout + proc.stderr)
    if proc.returncode == 0:
        return 0, None
    # train's refusal or halt is one line, the last on stderr.
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    return proc.returncode, lines[-1] if lines else f"exit code {proc.returncode}"


def read_run(method: str, lr: float, run_dir: Path) -> MethodResult:
    """Collect one finished run's row from its summary.json and metrics.jsonl."""
    summary = finished_summary(run_dir)
    rows = read_metrics(RunPaths(run_dir).metrics)
    tokens = sum(r["tokens"] for r in rows)
    step_time = sum(r["step_time_s"] for r in rows)
    peak = max(r["peak_mem_bytes"] for r in rows)
    trainable, total = summary["trainable_params"], summary["total_params"]
    return MethodResult(
        method=method,
        lr=lr,
        status="ok",
        trainable_params=trainable,
        total_params=total,
        trainable_pct=100.0 * trainable / total,
        peak_rss_gib=peak / 2**30,
        tokens_per_s=tokens / step_time if step_time > 0 else None,
        train_time_s=summary["train_time_s"],
        # Rows per step; one example each when unpacked (the prompt methods need that anyway).
        examples_seen=sum(r["micro_batch_size"] * r["grad_accum"] for r in rows),
        eval_loss=summary.get("eval_loss"),
        exact_match=summary.get("eval_exact_match"),
    )


def refusals(
    config: str | None,
    methods: list[str],
    lrs: dict[str, float],
    out_dir: Path,
    overrides: list[str],
    reuse: bool = False,
) -> dict[str, MethodResult]:
    """Each method's run config checked as its `leantune train` checks it, before any run: the
    rows of the methods that must not start, by name. A missing optional package (the method's
    own requirement, `MissingPackage`) makes a "skipped" row with its install line; any other
    refusal a "failed" one with train's exit code 2. With `reuse`, finished runs are not checked
    (they are read back)."""
    refused: dict[str, MethodResult] = {}
    for method in methods:
        run_dir = out_dir / method
        if reuse and RunPaths(run_dir).summary.is_file():
            continue
        try:
            load_config(config, run_overrides(method, lrs[method], run_dir, overrides, False))
        except MissingPackage as e:
            refused[method] = MethodResult(
                method, lrs[method], "skipped", error=str(e), install=e.install
            )
        except ConfigError as e:
            refused[method] = MethodResult(
                method, lrs[method], "failed", error=f"ConfigError: {e}", exit_code=2
            )
    return refused


def run_methods(
    config: str | None,
    methods: list[str],
    lrs: dict[str, float],
    out_dir: Path,
    overrides: list[str],
    log: Log = print,
    reuse: bool = False,
    refused: dict[str, MethodResult] | None = None,
) -> tuple[list[MethodResult], float | None]:
    """Train each method in turn; returns the rows and the base model's exact match.

    With `reuse`, a method whose run under `out_dir` already finished (has summary.json) is read
    back instead of trained again: an interrupted benchmark continues, or one method is re-run
    after deleting its folder. The caller answers for those runs having used the same settings.
    `refused` (default: `refusals` of `methods`) are rows as they are: those methods never run.
    """
    if refused is None:
        refused = refusals(config, methods, lrs, out_dir, overrides, reuse)
    results: list[MethodResult] = []
    base_exact_match: float | None = None
    # The base model is the same for every method: the first run that starts also evaluates it,
    # unless the caller already has that number (train.eval_base=false among the overrides).
    first = next((m for m in methods if m not in refused), None)
    if "train.eval_base=false" in overrides:
        first = None
    for i, method in enumerate(methods):
        run_dir = out_dir / method
        if method in refused:
            results.append(refused[method])
            continue
        if reuse and RunPaths(run_dir).summary.is_file():
            log(f"[{i + 1}/{len(methods)}] {method}: reusing the finished run in {run_dir}")
            results.append(read_run(method, lrs[method], run_dir))
            if method == first:
                base_exact_match = finished_summary(run_dir).get("base_exact_match")
            continue
        cmd = train_command(config, method, lrs[method], run_dir, overrides, base=method == first)
        log(f"[{i + 1}/{len(methods)}] {method} (lr {lrs[method]:g}) -> {run_dir}")
        t0 = time.perf_counter()
        code, reason = run_logged(cmd, out_dir / f"{method}.log")
        # A failure is a row of the table, not the end of the benchmark.
        if reason is not None:
            log(f"    failed: {reason}")
            failed = MethodResult(method, lrs[method], "failed", error=reason, exit_code=code)
            results.append(failed)
            continue
        row = read_run(method, lrs[method], run_dir)
        if method == first:
            base_exact_match = finished_summary(run_dir).get("base_exact_match")
        log(f"    done in {time.perf_counter() - t0:.0f} s")
        results.append(row)
    add_retention(results)
    return results, base_exact_match


def add_retention(results: list[MethodResult], base_loss: float | None = None) -> None:
    """Quality retention against full fine-tuning: the exact match as a share of full's, and
    (given the base model's held-out loss) the loss reduction as a share of full's."""
    full = next((r for r in results if r.method == BASELINE and r.status == "ok"), None)
    if full is None:
        return
    for r in results:
        if full.exact_match and r.exact_match is not None:  # full at 0 leaves no share
            r.retention = r.exact_match / full.exact_match
        gain = None if base_loss is None or full.eval_loss is None else base_loss - full.eval_loss
        # Only when full lowered the loss: otherwise the share is meaningless or divides by 0.
        if gain and gain > 0 and r.eval_loss is not None:
            r.loss_retention = (base_loss - r.eval_loss) / gain  # type: ignore[operator]


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(
    results: list[MethodResult], base_exact_match: float | None, base_loss: float | None = None
) -> str:
    """The benchmark as a Markdown table (retention relative to `full`)."""
    head = (
        "| method | lr | trainable params | trainable % | peak RSS (GiB) | tokens/s "
        "| train time (s) | examples seen | held-out loss | loss retention vs full "
        "| exact match | exact-match retention vs full |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in results:
        if r.status != "ok":
            error = (r.error or "").replace("|", "/")  # a '|' would split the Markdown row
            lines.append(f"| {r.method} | {r.lr:g} | {r.status}: {error} |" + " |" * 9)
            continue
        lines.append(
            f"| {r.method} | {r.lr:g} | {_fmt(r.trainable_params, ',')} "
            f"| {_fmt(r.trainable_pct, '.3f')} "
            f"| {_fmt(r.peak_rss_gib, '.2f')} | {_fmt(r.tokens_per_s, '.0f')} "
            f"| {_fmt(r.train_time_s, '.1f')} | {_fmt(r.examples_seen, ',')} "
            f"| {_fmt(r.eval_loss, '.4f')} | {_fmt(r.loss_retention, '.0%')} "
            f"| {_fmt(r.exact_match, '.1%')} | {_fmt(r.retention, '.0%')} |"
        )
    foot = ""
    if base_exact_match is not None:
        foot = f"\nExact match of the base model before training: {base_exact_match:.1%}.\n"
    if base_loss is not None:
        foot += f"\nHeld-out loss of the base model before training: {base_loss:.4f}.\n"
    return head + "\n".join(lines) + "\n" + foot


def plot(results: list[MethodResult], path: Path) -> None:
    """Bar charts of trainable %, peak memory, throughput and exact match per method."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed, or may exist
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok"]
    panels = [
        ("trainable params (%)", [r.trainable_pct for r in ok]),
        ("peak RSS (GiB)", [r.peak_rss_gib for r in ok]),
        ("tokens/s", [r.tokens_per_s for r in ok]),
        ("exact match", [r.exact_match for r in ok]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    names = [r.method for r in ok]
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(names, [0.0 if v is None else v for v in values], color="#4C72B0")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(
    results: list[MethodResult],
    base_exact_match: float | None,
    meta: dict[str, Any],
    out: Path,
    base_loss: float | None = None,
) -> dict[str, Any]:
    """Write methods.md, methods.json and methods.png under `out`; returns the JSON payload."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        **meta,
        "base_exact_match": base_exact_match,
        "base_eval_loss": base_loss,
        "results": [asdict(r) for r in results],
    }
    write_file(out / TABLE_FILE, markdown_table(results, base_exact_match, base_loss))
    write_file(out / JSON_FILE, json.dumps(payload, indent=2) + "\n")
    if any(r.status == "ok" for r in results):
        plot(results, out / PLOT_FILE)
    return payload


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import platform

    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    # platform.processor() is often empty or just the architecture on Linux; cpuinfo names
    # the model.
    try:
        with open("/proc/cpuinfo") as f:
            model = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "")
        if model:
            info["cpu"] = model
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
