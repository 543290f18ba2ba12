"""What a run reports: metrics.jsonl (one object per optimizer step), a progress bar, memory;
and the progress line of eval and generate."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from leantune.core.process_memory import current_rss_bytes, peak_rss_bytes, status_bytes
from leantune.core.writes import append_text, write_file
from leantune.eval.progress import GenerationProgress


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA allocator peak on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


_reported = {"peak": 0}
"""The highest CPU peak `memory_stats` reported since `start_training_memory`: a peak never falls,
though the kernel's VmHWM can trail an RSS reported before it."""


def start_training_memory() -> int | None:
    """At the start of training on CPU: the process's peak so far (the load phase), with the
    kernel's high-water mark (VmHWM) then reset, so that the peaks `memory_stats` reports from
    here on are training's. None where /proc/self cannot say or reset it."""
    # The load phase's RSS counts the checkpoint's file pages while they are mapped, a peak
    # training never reaches again; without the reset it would stand for training's.
    peak = status_bytes("VmHWM")
    _reported["peak"] = 0
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux 4.0+, proc(5))
    except OSError:  # not Linux, or /proc read-only: the peak stays the process's, load included
        return None
    return peak


def memory_stats(device: torch.device) -> dict[str, int]:
    """Current and peak memory for a metrics row: CUDA allocated and reserved (each with its
    peak), or on CPU the process's resident set size (RSS) now, its anonymous part (the run's
    tensors and heap; the rest is file pages such as a mapped checkpoint) and its peak since
    `start_training_memory` (since the start of the process before it runs)."""
    if device.type == "cuda":
        return {
            "mem_allocated_bytes": int(torch.cuda.memory_allocated(device)),
            "mem_reserved_bytes": int(torch.cuda.memory_reserved(device)),
            "peak_mem_bytes": int(torch.cuda.max_memory_allocated(device)),
            "peak_mem_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        }
    rss = current_rss_bytes()
    hwm = status_bytes("VmHWM")
    peak = hwm if hwm is not None else peak_memory_bytes(device)  # ru_maxrss is never reset
    # The kernel updates its high-water mark lazily, so it can trail the current RSS, and after
    # RSS falls again, trail an RSS reported earlier: the peak is the highest seen.
    _reported["peak"] = max(_reported["peak"], rss, peak)
    out = {"rss_bytes": rss, "peak_mem_bytes": _reported["peak"]}
    # The anonymous part is the run's tensors and heap; the rest of RSS is file pages (a mapped
    # checkpoint) that the kernel can drop, so it is the better measure of what training holds.
    anon = status_bytes("RssAnon")
    if anon is not None:
        out["rss_anon_bytes"] = anon
    return out


class MetricsLog:
    """Appends one JSON object per step to `metrics.jsonl`; on resume, drops steps after `step`
    so the file holds exactly one trajectory."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = path
        # The resumed run recomputes every step after resume_step: their old rows go, and a
        # fresh start (resume_step 0) empties the file of an earlier attempt's rows.
        kept: list[str] = []
        if resume_step > 0 and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a kill
        write_file(path, "".join(x + "\n" for x in kept))

    def write(self, record: dict[str, Any]) -> None:
        append_text(self.path, json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All step records of a metrics.jsonl."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    """Step progress bar with ETA on stderr."""
    return tqdm(
        total=total,
        initial=initial,
        desc="train",
        unit="step",
        disable=not enabled,
        dynamic_ncols=True,
        file=sys.stderr,
    )


class GenerationBar:
    """The progress line of eval and generate on stderr: prompts answered of all, generated
    tokens/s, elapsed and ETA (from the decoding work left, so a batch that stops early brings
    it in). Shown only on a terminal; redrawn at most once a second, at every decoding step
    after that, so a long batch is never silent. Pass it as `on_progress`, `close()` after."""

    def __init__(
        self, desc: str, enabled: bool = True, file: TextIO | None = None, leave: bool = True
    ):
        self.desc = desc
        self.file = file if file is not None else sys.stderr
        # Not on a pipe or a log file: a redrawn line there is a screenful of carriage returns.
        self.enabled = enabled and self.file.isatty()
        self.leave = leave
        self._bar: Any = None

    def __call__(self, progress: GenerationProgress) -> None:
        if not self.enabled:
            return
        elapsed = progress.elapsed_s
        rate = progress.new_tokens / elapsed if elapsed > 0 else 0.0
        text = f"{self.desc}: {progress.done}/{progress.total} examples, {rate:.1f} tok/s"
        if self._bar is None:
            self._bar = tqdm(
                total=progress.work_total,
                desc=text,
                file=self.file,
                bar_format="{desc} [{elapsed}, ETA {remaining}]",
                mininterval=1.0,
                miniters=1,  # tqdm's adaptive default would skip the clock check on slow steps
                dynamic_ncols=True,
                leave=self.leave,
            )
            self._bar.start_t -= elapsed  # the clock of the call, which began before this step
        else:
            self._bar.set_description_str(text, refresh=False)
        self._bar.update(progress.work_done - self._bar.n)

    def close(self) -> None:
        """Draws the final line (or clears it without `leave`); the next call starts anew."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
