"""What monitoring costs per training step, on the demo (SmolLM2-135M, LoRA, 512-token rows).

    PYTHONPATH=src python benchmarks/monitor_overhead.py [--steps 15] [--pairs 3]

The same short run, alternately without and with the Prometheus endpoint (a scraper thread
fetching /metrics every `--scrape-every` seconds, as Prometheus would), `--pairs` times in one
process, so both arms share the machine's state. Reported:

- the loop's time per step (between two records reaching the sinks: the step, its sinks, and
  nothing else, since evaluation is off and the only checkpoint comes after the last record),
  median per run, per pair and per arm; on a shared machine their differences are noise, far
  larger than the cost, so the direct measures below are the numbers to read;
- the cost measured directly, per step: the time inside each sink's calls, and inside
  `StepStats.fields` (padding, MFU, data wait, ETA, CPU, RSS: on in both arms); per scrape the
  time the endpoint took to answer (it runs on a server thread, beside the step, and waits for
  the GIL while the step holds it: an upper bound on what it takes from the step).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from leantune.monitor import step_stats
from leantune.monitor.prometheus import PrometheusSink
from leantune.monitor.sinks import Sinks
from leantune.training import recipe
from leantune.training.checks import load_config

DEMO = Path(recipe.__file__).resolve().parents[1] / "configs" / "demo.yaml"


class Timed:
    """A sink wrapped to add the time of its calls to `spent[name]`."""

    def __init__(self, sink: Any, spent: dict[str, float]):
        self.sink, self.spent, self.name = sink, spent, type(sink).__name__

    def _timed(self, method: str, arg: Any) -> None:
        start = time.perf_counter()
        getattr(self.sink, method)(arg)
        self.spent[self.name] += time.perf_counter() - start

    def start(self, step: int) -> None:
        self.sink.start(step)

    def metrics(self, record: dict[str, Any]) -> None:
        self._timed("metrics", record)

    def eval(self, row: dict[str, Any]) -> None:
        self._timed("eval", row)

    def event(self, event: dict[str, Any]) -> None:
        self._timed("event", event)

    def close(self) -> None:
        self.sink.close()


class Clock:
    """The last sink: notes when each record arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def start(self, step: int) -> None:
        pass

    def metrics(self, record: dict[str, Any]) -> None:
        self.times.append(time.perf_counter())

    def eval(self, row: dict[str, Any]) -> None:
        pass

    def event(self, event: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class Scraper(threading.Thread):
    """Fetches /metrics every `every` seconds while the run trains; times each answer."""

    def __init__(self, sink: PrometheusSink, every: float):
        super().__init__(daemon=True)
        self.sink, self.every = sink, every
        self.took: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            if self.sink.server is None:
                continue
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(self.sink.url + "/metrics", timeout=10) as r:
                    r.read()
            except OSError:
                continue  # the run closed the server between two scrapes
            self.took.append(time.perf_counter() - start)


def one_run(args: argparse.Namespace, out: Path, prometheus: bool) -> dict[str, Any]:
    spent: dict[str, float] = defaultdict(float)
    clock = Clock()
    scrapers: list[Scraper] = []
    built = recipe._sinks

    def sinks(*a: Any, **k: Any) -> Sinks:
        inner = built(*a, **k).sinks
        for s in inner:
            if isinstance(s, PrometheusSink):
                scrapers.append(Scraper(s, args.scrape_every))
                scrapers[-1].start()
        return Sinks([*[Timed(s, spent) for s in inner], clock])

    fields = step_stats.StepStats.fields
    stats_time: list[float] = []

    def timed_fields(self: step_stats.StepStats, *a: Any, **k: Any) -> dict[str, Any]:
        start = time.perf_counter()
        row = fields(self, *a, **k)
        stats_time.append(time.perf_counter() - start)
        return row

    overrides = [
        f"run.dir={out}",
        f"train.max_steps={args.steps}",
        "train.save_every=0",
        "train.eval_exact_match=false",
        "data.eval=null",
        "run.progress=false",
        *(["monitor.metrics_port=0"] if prometheus else []),
    ]
    recipe._sinks = sinks  # type: ignore[assignment]
    step_stats.StepStats.fields = timed_fields  # type: ignore[method-assign]
    try:
        recipe.train(load_config(str(DEMO), overrides), log=lambda _: None)
    finally:
        recipe._sinks = built  # type: ignore[assignment]
        step_stats.StepStats.fields = fields  # type: ignore[method-assign]
        for s in scrapers:
            s.done.set()
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    return {
        "prometheus": prometheus,
        "step_s": statistics.median(gaps),
        "sinks_s": {k: v / args.steps for k, v in spent.items()},
        "stats_s": statistics.median(stats_time),
        "scrapes": [t for s in scrapers for t in s.took],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--scrape-every", type=float, default=1.0)
    args = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for prometheus in (False, True):
                name = f"{i}-{'prom' if prometheus else 'base'}"
                runs.append(one_run(args, Path(tmp) / name, prometheus))
                r = runs[-1]
                print(f"run {name}: {r['step_s'] * 1e3:.1f} ms/step", flush=True)
    base = [r for r in runs if not r["prometheus"]]
    prom = [r for r in runs if r["prometheus"]]
    step = statistics.median(r["step_s"] for r in base)
    step_prom = statistics.median(r["step_s"] for r in prom)
    per_sink = {
        name: statistics.median(r["sinks_s"].get(name, 0.0) for r in prom)
        for name in prom[0]["sinks_s"]
    }
    stats = statistics.median(r["stats_s"] for r in runs)
    scrapes = [t for r in prom for t in r["scrapes"]]
    scrape = statistics.median(scrapes) if scrapes else float("nan")
    # A scrape runs beside the step: at most it takes its time from the step, once a period.
    scrape_share = scrape / args.scrape_every
    direct = per_sink.get("JsonlSink", 0) + per_sink.get("PrometheusSink", 0) + stats
    share = direct / step + scrape_share
    pairs = [[base[i]["step_s"], prom[i]["step_s"]] for i in range(len(base))]
    print()
    for i, (b, q) in enumerate(pairs):
        print(f"pair {i}: without {b * 1e3:.1f} ms/step, with {q * 1e3:.1f} ({q / b - 1:+.1%})")
    print(f"{'':34} {'per step':>12} {'share of step':>14}")
    print(f"{'loop time per step, without':34} {step * 1e3:10.1f}ms")
    print(f"{'loop time per step, with':34} {step_prom * 1e3:10.1f}ms {step_prom / step - 1:13.2%}")
    for name, t in per_sink.items():
        print(f"{'  in ' + name:34} {t * 1e6:10.1f}us {t / step:13.4%}")
    print(f"{'  in StepStats.fields':34} {stats * 1e6:10.1f}us {stats / step:13.4%}")
    print(f"{'  one scrape (every ' + str(args.scrape_every) + ' s)':34} {scrape * 1e3:10.2f}ms "
          f"{scrape_share:13.4%}")  # fmt: skip
    print(f"{'JSONL + Prometheus + stats + scrape':34} {'':12} {share:13.4%}")
    print(
        json.dumps(
            {
                "benchmark": "monitor_overhead",
                "model": "smollm2-135m-instruct",
                "steps": args.steps,
                "pairs": args.pairs,
                "step_s_without": round(step, 5),
                "step_s_with": round(step_prom, 5),
                "pairs_step_s": [[round(b, 4), round(q, 4)] for b, q in pairs],
                "sink_us": {k: round(v * 1e6, 1) for k, v in per_sink.items()},
                "step_stats_us": round(stats * 1e6, 1),
                "scrape_ms": round(scrape * 1e3, 3),
                "scrape_every_s": args.scrape_every,
                "overhead_share": round(share, 6),
            }
        )
    )


if __name__ == "__main__":
    main()
