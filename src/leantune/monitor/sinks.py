"""Where the loop's records go: one protocol, any number of sinks.

The loop emits each step's metrics record, each periodic eval row and each event once, to a
`Sinks` fan-out; it never knows which sinks exist. `metrics.jsonl`/`eval.jsonl` (always) and
the console progress bar are the built-in ones; a monitoring backend (Prometheus, TensorBoard,
W&B) is another `Sink` added at set-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from leantune.layout import RunPaths
from leantune.monitor.metrics import MetricsLog, progress_bar

Record = dict[str, Any]


class Sink(Protocol):
    """A consumer of the loop's records. Each call is made once per record, in order."""

    def start(self, step: int) -> None:
        """The loop (re)starts after `step` applied updates: at the start, after a resume and
        after a rollback. A sink that keeps history drops what lies beyond `step`."""

    def metrics(self, record: Record) -> None:
        """One applied optimizer step (the row of `metrics.jsonl`)."""

    def eval(self, row: Record) -> None:
        """One periodic evaluation (the row of `eval.jsonl`)."""

    def event(self, event: Record) -> None:
        """One guard/OOM/signal/resume event, as written to `events.jsonl`."""

    def close(self) -> None:
        """The loop has ended (normally or not)."""


class Sinks:
    """Fans every record out to each sink."""

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = list(sinks)

    def start(self, step: int) -> None:
        for s in self.sinks:
            s.start(step)

    def metrics(self, record: Record) -> None:
        for s in self.sinks:
            s.metrics(record)

    def eval(self, row: Record) -> None:
        for s in self.sinks:
            s.eval(row)

    def event(self, event: Record) -> None:
        for s in self.sinks:
            s.event(event)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class JsonlSink:
    """`metrics.jsonl` and `eval.jsonl`: exactly one trajectory, cut back on (re)start."""

    def __init__(self, run_dir: Path, with_eval: bool):
        self.metrics_path = RunPaths(run_dir).metrics
        self.eval_path = RunPaths(run_dir).eval if with_eval else None
        self._metrics: MetricsLog | None = None
        self._eval: MetricsLog | None = None

    def start(self, step: int) -> None:
        self._metrics = MetricsLog(self.metrics_path, step)
        self._eval = MetricsLog(self.eval_path, step) if self.eval_path is not None else None

    def metrics(self, record: Record) -> None:
        assert self._metrics is not None, "start() first"
        self._metrics.write(record)

    def eval(self, row: Record) -> None:
        if self._eval is not None:
            self._eval.write(row)

    def event(self, event: Record) -> None:
        # Events have their own append-only file (`monitor.events.EventLog`), which keeps the
        # decisions of attempts later rolled back; cutting back on restart would lose them.
        pass

    def close(self) -> None:
        pass  # every write is appended and closed at once: nothing is left open


def reward_field(record: Record) -> str:
    """A preference step's reward accuracy and margin, as the progress bar shows them (KTO's
    unpaired answers have no accuracy: the margin alone)."""
    margin = f"margin {record['rewards/margins']:+.3g}"
    accuracy = record.get("rewards/accuracies")
    return margin if accuracy is None else f"acc {accuracy:.0%} {margin}"


class ConsoleSink:
    """The progress bar (steps, ETA, loss, tokens/s; reward accuracy and margin in a preference
    run) and one line per periodic eval."""

    def __init__(self, max_steps: int, enabled: bool, log: Callable[[str], None]):
        self.max_steps = max_steps
        self.enabled = enabled
        self.log = log
        self._bar: Any = None

    def start(self, step: int) -> None:
        if self._bar is None:
            self._bar = progress_bar(self.max_steps, step, self.enabled)
        else:  # a rollback: the bar goes back with the run
            self._bar.n = step
            self._bar.refresh()

    def metrics(self, record: Record) -> None:
        fields = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
        if "rewards/margins" in record:
            # A preference run: one field for the two figures that say it learns; the other
            # reward metrics are in metrics.jsonl and the monitoring sinks.
            fields["rewards"] = reward_field(record)
        self._bar.set_postfix(fields)
        self._bar.update(1)

    def eval(self, row: Record) -> None:
        # Floats only: the scores, not the step number.
        self.log(", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)))

    def event(self, event: Record) -> None:
        pass  # EventLog already printed it

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
