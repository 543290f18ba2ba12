"""A real Prometheus server (Debian's `prometheus` package) scrapes a tiny run's endpoint every
second; the loss series read back through its HTTP query API equals metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import chat_rows, free_port, make_config, write_jsonl

from leantune.monitor.metrics import read_metrics
from leantune.monitor.sinks import Sinks
from leantune.training import recipe, run_monitoring

DEADLINE_S = 60.0  # generous: the machine may be loaded; a healthy wait is ~1 s


class PrometheusServer:
    """`prometheus` scraping one target every second, with its data in a temp directory."""

    def __init__(self, tmp: Path, target_port: int):
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: leantune\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target_port}']\n"
        )
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: Any) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read()) if "/api/" in path else r.read().decode()

    def query(self, expr: str, **params: Any) -> list[dict[str, Any]]:
        answer = self.get("/api/v1/query", query=expr, **params)
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
            try:
                self.get("/-/ready")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


class WaitForScrape:
    """A sink behind the Prometheus sink: holds each step until Prometheus has stored it, so
    every step is scraped at least once (a tiny step takes milliseconds)."""

    def __init__(self, server: PrometheusServer):
        self.server = server
        self.waited: list[float] = []

    def start(self, step: int) -> None:
        pass

    def metrics(self, record: dict[str, Any]) -> None:
        start = time.monotonic()
        while True:
            found = self.server.query('leantune_step{job="leantune"}')
            if found and float(found[0]["value"][1]) == record["step"]:
                break
            assert time.monotonic() - start < DEADLINE_S, "prometheus never scraped the step"
            time.sleep(0.05)
        self.waited.append(time.monotonic() - start)

    def eval(self, row: dict[str, Any]) -> None:
        pass

    def event(self, event: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture()
def prometheus(tmp_path: Path) -> Iterator[tuple[PrometheusServer, int]]:
    port = free_port()
    server = PrometheusServer(tmp_path, port)
    try:
        server.wait_ready()
        yield server, port
    finally:
        server.stop()


def _series(server: PrometheusServer, name: str, at: float) -> dict[float, float]:
    """Every stored sample of `name` in the last 10 minutes (a range vector: raw samples)."""
    (result,) = server.query(f'{name}{{job="leantune"}}[10m]', time=at)
    return {float(t): float(v) for t, v in result["values"]}


def test_prometheus_scrapes_the_run_and_its_loss_series_equals_metrics_jsonl(
    prometheus: tuple[PrometheusServer, int],
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, port = prometheus
    waiter = WaitForScrape(server)
    built = run_monitoring.sinks_for
    monkeypatch.setattr(
        run_monitoring, "sinks_for", lambda *a, **k: Sinks([*built(*a, **k).sinks, waiter])
    )
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(16))
    run = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir, train_file, run, f"monitor.metrics_port={port}", "train.max_steps=5"
    )
    recipe.train(cfg, log=lambda _: None)
    assert len(waiter.waited) == 5
    rows = read_metrics(run / "metrics.jsonl")
    now = time.time()
    steps = _series(server, "leantune_step", now)
    losses = _series(server, "leantune_train_loss", now)
    assert set(steps) == set(losses)  # one scrape holds both, at one timestamp
    by_step: dict[int, set[float]] = {}
    for t, step in steps.items():
        if step >= 1:
            by_step.setdefault(int(step), set()).add(losses[t])
    # Each step was scraped at least once, always with that step's loss, exactly.
    assert by_step == {r["step"]: {r["loss"]} for r in rows}
    # The same through query_range (an evaluation every second) and the run's identity.
    start = min(steps)
    answer = server.get(
        "/api/v1/query_range", query='leantune_step{job="leantune"}', start=start, end=now, step=1
    )
    values = [float(v) for _, v in answer["data"]["result"][0]["values"]]
    assert values == sorted(values) and values[-1] == 5
    (info,) = server.query("leantune_run_info", time=max(steps))
    assert info["metric"]["method"] == "lora" and info["metric"]["run"] == "run"
    up = _series(server, "up", now)
    assert 1.0 in up.values()
