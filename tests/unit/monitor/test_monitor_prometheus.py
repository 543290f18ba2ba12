"""The Prometheus endpoint of a run: scraped while a tiny run trains, parsed with
prometheus-client's own parser, and checked against metrics.jsonl, the naming rules and the
dashboard and alert rules under deploy/."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import chat_rows, free_port, make_config, run_cli, tiny_train_args, write_jsonl

from leantune.monitor.metrics import read_metrics
from leantune.monitor.prometheus import PrometheusSink, RunFacts
from leantune.monitor.sinks import Sinks
from leantune.testing.faults import LOSS_SCALE_ENV, OOM_STEP_ENV
from leantune.training import recipe, run_monitoring

Families = dict[str, Any]  # family name -> prometheus_client Metric


def parse(text: str) -> Families:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: Families, name: str, **labels: str) -> float:
    """The value of sample `name` (with `labels`) of a parsed scrape."""
    for family in families.values():
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise KeyError(f"{name}{labels} not in the scrape")


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


@dataclass
class Scrape:
    """One scrape, taken right after a sink call."""

    after: str  # "start", "metrics", "eval"
    record: dict[str, Any]
    families: Families
    health: dict[str, Any]


@dataclass
class ScrapingSink:
    """Placed after the `PrometheusSink`: scrapes /metrics and /health after each record, as
    Prometheus would between two steps."""

    prometheus: PrometheusSink
    scrapes: list[Scrape] = field(default_factory=list)
    url: str = ""

    def _scrape(self, after: str, record: dict[str, Any]) -> None:
        self.url = self.prometheus.url
        _, kind, text = get(self.url + "/metrics")
        assert kind.startswith("text/plain")
        health = json.loads(get(self.url + "/health")[2])
        self.scrapes.append(Scrape(after, record, parse(text), health))

    def start(self, step: int) -> None:
        self._scrape("start", {"step": step})

    def metrics(self, record: dict[str, Any]) -> None:
        self._scrape("metrics", record)

    def eval(self, row: dict[str, Any]) -> None:
        self._scrape("eval", row)

    def event(self, event: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def with_scraper(monkeypatch: pytest.MonkeyPatch) -> list[ScrapingSink]:
    """Make every run of this test append a `ScrapingSink` behind its Prometheus sink."""
    built = run_monitoring.sinks_for
    made: list[ScrapingSink] = []

    def sinks(*args: Any, **kwargs: Any) -> Sinks:
        out = built(*args, **kwargs)
        prometheus = [s for s in out.sinks if isinstance(s, PrometheusSink)]
        assert len(prometheus) == 1, "monitor.metrics_port is set: one Prometheus sink"
        made.append(ScrapingSink(prometheus[0]))
        return Sinks([*out.sinks, made[-1]])

    monkeypatch.setattr(run_monitoring, "sinks_for", sinks)
    return made


@dataclass
class LiveRun:
    run_dir: Path
    scrapes: list[Scrape]
    url: str


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """A 6-step run with evals, a checkpoint every 2 steps, an OOM recovered at step 2 and a
    loss spike (guard: warn) at step 4, scraped after every record."""
    tmp = tmp_path_factory.mktemp("live")
    mp = pytest.MonkeyPatch()
    try:
        made = with_scraper(mp)
        mp.setenv(OOM_STEP_ENV, "2")
        mp.setenv(LOSS_SCALE_ENV, "4:50")
        train_file = write_jsonl(tmp / "train.jsonl", chat_rows(24))
        eval_file = write_jsonl(tmp / "eval.jsonl", chat_rows(4, offset=100))
        cfg = make_config(
            tiny_llama_dir, train_file, tmp / "run", "monitor.metrics_port=0",
            "data.pack=false", "train.max_steps=6", "train.save_every=2",
            "guard.loss_spike=warn", "guard.warmup=2", f"data.eval={eval_file}",
            "train.eval_every=3", "train.micro_batch_size=2", "train.global_batch_size=4",
        )  # fmt: skip
        recipe.train(cfg, log=lambda _: None)
        (sink,) = made
        yield LiveRun(tmp / "run", sink.scrapes, sink.url)
    finally:
        mp.undo()


def test_scraped_values_move_with_the_run_and_equal_metrics_jsonl(live: LiveRun) -> None:
    rows = read_metrics(live.run_dir / "metrics.jsonl")
    after_steps = [s for s in live.scrapes if s.after == "metrics"]
    assert [s.record["step"] for s in after_steps] == [1, 2, 3, 4, 5, 6]
    for scrape, row in zip(after_steps, rows, strict=True):
        f = scrape.families
        assert value(f, "leantune_step") == row["step"]
        assert value(f, "leantune_train_loss") == row["loss"]  # exact: repr round-trips floats
        assert value(f, "leantune_learning_rate") == row["lr"]
        assert value(f, "leantune_grad_norm") == row["grad_norm"]
        assert value(f, "leantune_tokens_per_second") == row["tokens_per_s"]
        assert value(f, "leantune_padding_ratio") == row["padding_ratio"]
        assert value(f, "leantune_mfu_ratio") == row["mfu"]
        assert value(f, "leantune_eta_seconds") == row["eta_s"]
        assert value(f, "leantune_memory_used_bytes") == row["rss_bytes"]
        assert value(f, "leantune_memory_peak_bytes") == row["peak_mem_bytes"]
        assert value(f, "leantune_micro_batch_size") == row["micro_batch_size"]
        assert scrape.health == {
            "status": "ok",
            "step": row["step"],
            "last_step_time": value(f, "leantune_last_step_timestamp_seconds"),
        }
    # Counters only grow; the token counter is the sum of the records' non-pad tokens.
    tokens = [value(s.families, "leantune_tokens_total") for s in after_steps]
    assert tokens == [sum(r["tokens"] for r in rows[: k + 1]) for k in range(6)]
    stamps = [value(s.families, "leantune_last_step_timestamp_seconds") for s in after_steps]
    assert stamps == sorted(stamps) and stamps[0] > 1e9
    assert value(after_steps[-1].families, "leantune_eta_seconds") == 0
    first = live.scrapes[0]
    assert first.after == "start" and value(first.families, "leantune_step") == 0
    assert math.isnan(value(first.families, "leantune_train_loss"))  # no step yet


def test_eval_loss_guard_oom_and_checkpoint_metrics(live: LiveRun) -> None:
    evals = [json.loads(x) for x in (live.run_dir / "eval.jsonl").read_text().splitlines()]
    after_eval = [s for s in live.scrapes if s.after == "eval"]
    assert [s.record["step"] for s in after_eval] == [3, 6]
    for scrape, row in zip(after_eval, evals, strict=True):
        assert value(scrape.families, "leantune_eval_loss") == row["eval_loss"]
    by_step = {s.record["step"]: s.families for s in live.scrapes if s.after == "metrics"}
    assert math.isnan(value(by_step[1], "leantune_eval_loss"))
    # The OOM at step 2 was recovered (micro-batch 2 -> 1); the spike at step 4 was detected.
    assert value(by_step[1], "leantune_oom_recoveries_total", kind="train") == 0
    assert value(by_step[2], "leantune_oom_recoveries_total", kind="train") == 1
    assert value(by_step[2], "leantune_micro_batch_size") == 1
    assert value(by_step[3], "leantune_guard_events_total", kind="loss_spike") == 0
    assert value(by_step[4], "leantune_guard_events_total", kind="loss_spike") == 1
    assert value(by_step[6], "leantune_guard_events_total", kind="nonfinite") == 0
    assert value(by_step[6], "leantune_events_total", kind="oom") == 1
    # Checkpoints at steps 2, 4 and 6 (saved after the step's record went to the sinks).
    assert math.isnan(value(by_step[2], "leantune_checkpoint_step"))
    assert [value(by_step[k], "leantune_checkpoint_step") for k in (3, 4, 5, 6)] == [2, 2, 4, 4]
    ages = [value(by_step[k], "leantune_checkpoint_age_seconds") for k in (3, 4)]
    assert 0 <= ages[0] <= ages[1] < 600
    info = by_step[1]["leantune_run_info"].samples[0]
    assert info.name == "leantune_run_info" and info.value == 1
    assert info.labels["method"] == "lora" and info.labels["run"] == "run"
    assert value(by_step[1], "leantune_max_steps") == 6
    assert value(by_step[1], "leantune_memory_planned_peak_bytes") > 0
    assert value(by_step[1], "leantune_memory_budget_bytes") > 0
    assert value(by_step[1], "leantune_device_peak_flops") > 0


# The Prometheus naming rules (https://prometheus.io/docs/practices/naming/), checked over every
# family the endpoint serves.
UNIT_WORDS = {
    "seconds": ("time", "duration", "age", "eta", "timestamp", "latency"),
    "bytes": ("memory", "bytes"),
}
ALLOWED_LABELS = {"kind", "run", "method", "model", "device", "precision"}


def test_every_family_follows_the_naming_rules(live: LiveRun) -> None:
    families = live.scrapes[-1].families
    assert len(families) > 30
    assert_naming_rules(families)


def assert_naming_rules(families: Families) -> None:
    """Every family of one scrape follows the naming rules above."""
    for name, family in families.items():
        assert name.startswith("leantune_") and "leantune" not in name[len("leantune_") :], name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert not name.endswith(("_percent", "_milliseconds", "_kilobytes", "_megabytes")), name
        sample_names = {s.name for s in family.samples}
        if family.type == "counter":
            assert sample_names <= {f"{name}_total", f"{name}_created"}, name
        else:
            assert not name.endswith("_total") or name.endswith("_cpu_seconds_total"), name
        if name.endswith("_created"):
            continue  # a counter's creation time, as every Python client writes it
        words = name.split("_")
        for unit, hints in UNIT_WORDS.items():
            if any(h in words for h in hints) and "per" not in words:
                assert unit in words, f"{name}: a {unit} quantity without the unit suffix"
        for s in family.samples:
            assert set(s.labels) <= ALLOWED_LABELS, (name, s.labels)
            if name.endswith("_ratio") and not math.isnan(s.value):
                assert 0 <= s.value <= 1, (name, s.value)
    # A label takes few values: the guard kinds, the OOM phases, the event kinds.
    kinds = {s.labels.get("kind") for f in families.values() for s in f.samples} - {None}
    assert len(kinds) <= 12


# A DPO step's record, as metrics.jsonl holds it (TRL's names; issue 34).
PREFERENCE_RECORD = {
    "step": 3, "loss": 0.61, "tokens": 96, "rewards/chosen": 0.0421, "rewards/rejected": -0.1873,
    "rewards/accuracies": 0.75, "rewards/margins": 0.2294, "logps/chosen": -14.25,
    "logps/rejected": -31.5,
}  # fmt: skip
PREFERENCE_GAUGES = {
    "leantune_rewards_chosen": "rewards/chosen",
    "leantune_rewards_rejected": "rewards/rejected",
    "leantune_rewards_accuracy_ratio": "rewards/accuracies",
    "leantune_rewards_margin": "rewards/margins",
    "leantune_logps_chosen": "logps/chosen",
    "leantune_logps_rejected": "logps/rejected",
}


def preference_scrape(tmp_path: Path) -> str:
    """/metrics after one SFT-like start and one DPO step's record."""
    facts = RunFacts("r", "lora", "m", "cpu", "fp32", 10, 1, 2)
    sink = PrometheusSink("127.0.0.1", 0, facts, tmp_path / "checkpoints", lambda _: None)
    sink.start(0)
    try:
        before = parse(get(sink.url + "/metrics")[2])
        for name in PREFERENCE_GAUGES:  # NaN until a preference step (an SFT run's stay NaN)
            assert math.isnan(value(before, name)), name
        sink.metrics(PREFERENCE_RECORD)
        return get(sink.url + "/metrics")[2]
    finally:
        sink.close()


def test_a_preference_steps_reward_metrics_are_served_under_the_naming_rules(
    tmp_path: Path,
) -> None:
    families = parse(preference_scrape(tmp_path))
    for name, key in PREFERENCE_GAUGES.items():
        assert families[name].type == "gauge"
        assert value(families, name) == PREFERENCE_RECORD[key], name
    assert_naming_rules(families)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Prometheus)")
def test_promtool_lints_the_reward_metrics_clean(tmp_path: Path) -> None:
    # Only the reward families: the lint speaks for what a preference run adds.
    text = "".join(
        line + "\n"
        for line in preference_scrape(tmp_path).splitlines()
        if any(f" {name} " in f"{line} " or line.startswith(name) for name in PREFERENCE_GAUGES)
    )
    assert text.count("# TYPE") == len(PREFERENCE_GAUGES)
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out


def test_the_server_stops_with_the_run_and_the_port_is_free_again(
    live: LiveRun, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(urllib.error.URLError):
        get(live.url + "/metrics")
    # Two runs one after the other on the same fixed port: the second binds it again.
    port = free_port()
    made = with_scraper(monkeypatch)
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    for name in ("a", "b"):
        cfg = make_config(
            tiny_llama_dir, train_file, tmp_path / name, f"monitor.metrics_port={port}",
            "train.max_steps=1",
        )  # fmt: skip
        recipe.train(cfg, log=lambda _: None)
    assert [m.url for m in made] == [f"http://127.0.0.1:{port}"] * 2
    assert [len(m.scrapes) for m in made] == [2, 2]
    with pytest.raises(urllib.error.URLError):  # and stopped again
        get(f"http://127.0.0.1:{port}/health")


def test_a_taken_port_exits_2_before_training_naming_the_field(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = tiny_train_args(tiny_llama_dir, train_file, tmp_path / "run")
        # The flag may stand between the overrides: the ones after it still apply.
        result = run_cli([*args[:3], "--metrics-port", str(port), *args[3:], "train.max_steps=1"])
    assert result.code == 2
    assert f"monitor.metrics_port={port}" in result.err and "--metrics-port" in result.err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


def test_a_port_out_of_range_is_refused_by_the_flag_and_the_config(tmp_path: Path) -> None:
    out = run_cli(["validate", "--help-fields"])
    assert "monitor.metrics_port" in out.out and "monitor.metrics_host" in out.out
    bad = run_cli(["train", "--metrics-port", "70000"])
    assert bad.code == 2 and "--metrics-port" in bad.err and "65535" in bad.err
    from leantune.config import ConfigError
    from leantune.training.checks import load_config

    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(2))
    with pytest.raises(ConfigError, match=r"monitor.metrics_port: .*0..65535"):
        load_config(None, [f"data.train={train_file}", "monitor.metrics_port=70000"])
    with pytest.raises(ConfigError, match=r"monitor\.metrics_host"):
        load_config(None, [f"data.train={train_file}", "monitor.metrics_host= "])


def test_the_endpoint_answers_404_elsewhere_and_events_map_to_counters(tmp_path: Path) -> None:
    facts = RunFacts("r", "lora", "m", "cpu", "fp32", 10, 1, 2)
    sink = PrometheusSink("127.0.0.1", 0, facts, tmp_path / "checkpoints", lambda _: None)
    sink.start(0)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            get(sink.url + "/")
        assert e.value.code == 404
        for kind, extra in [
            ("nonfinite", {}), ("rollback", {}), ("oom", {"micro_batch_size": 1}),
            ("oom", {}), ("oom_eval", {"eval_batch_size": 2}), ("resume", {}),
            ("a_kind_from_a_newer_version", {}),
        ]:  # fmt: skip
            sink.event({"kind": kind, "step": 1, "message": "", **extra})
        f = parse(get(sink.url + "/metrics")[2])
    finally:
        sink.close()
    assert value(f, "leantune_guard_events_total", kind="nonfinite") == 1
    assert value(f, "leantune_guard_events_total", kind="rollback") == 1
    assert value(f, "leantune_guard_events_total", kind="loss_spike") == 0
    # The OOM that gave up at micro-batch 1 carries no new micro-batch: not a recovery.
    assert value(f, "leantune_oom_recoveries_total", kind="train") == 1
    assert value(f, "leantune_oom_recoveries_total", kind="eval") == 1
    assert value(f, "leantune_events_total", kind="oom") == 2
    assert value(f, "leantune_events_total", kind="resume") == 1
    assert not any("newer" in str(s.labels) for fam in f.values() for s in fam.samples)
    assert math.isnan(value(f, "leantune_checkpoint_age_seconds"))  # no checkpoint yet


# deploy/: the Grafana dashboard, its provisioning, the scrape config and the alert rules.
DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "leantune.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"


def queried_metrics() -> dict[str, set[str]]:
    """Every leantune metric name that a dashboard panel or an alert rule queries."""
    import yaml

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = {f"panel {p['title']!r}": t["expr"] for p in dashboard["panels"] for t in p["targets"]}
    for var in dashboard["templating"]["list"]:
        exprs[f"variable {var['name']}"] = var["definition"]
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            exprs[f"alert {rule['alert']}"] = rule["expr"]
    return {where: set(re.findall(r"\bleantune_[a-z0-9_]+", e)) for where, e in exprs.items()}


def test_deploy_files_parse_and_point_at_each_other() -> None:
    import yaml

    dashboard = json.loads(DASHBOARD.read_text())
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/leantune.yaml").read_text()
    )["providers"][0]
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    assert datasource["type"] == "prometheus" and provider["type"] == "file"
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 12
    assert scrape["rule_files"] == ["alerts.yml"]
    assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("loss", "learning rate", "gradient norm", "tokens/s", "mfu", "padding",
                  "memory vs plan", "guard", "oom", "checkpoint age", "eta", "reward accuracy",
                  "rewards"):  # fmt: skip
        assert topic in titles, topic


def test_every_metric_a_panel_or_rule_queries_is_on_the_live_endpoint(live: LiveRun) -> None:
    served = {s.name for f in live.scrapes[-1].families.values() for s in f.samples}
    queried = queried_metrics()
    assert len(set().union(*queried.values())) >= 20
    missing = {where: names - served for where, names in queried.items() if names - served}
    assert missing == {}


def promtool(*args: str) -> str:
    import subprocess

    done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_promtool_accepts_the_rules_and_the_config_and_the_alert_tests_pass() -> None:
    assert "SUCCESS: 8 rules found" in promtool("check", "rules", str(ALERTS))
    assert "is valid prometheus config" in promtool(
        "check", "config", str(DEPLOY / "prometheus/prometheus.yml")
    )
    assert "SUCCESS" in promtool("test", "rules", str(DEPLOY / "prometheus/alerts_test.yml"))
