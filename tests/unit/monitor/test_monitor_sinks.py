"""The optional monitoring sinks: TensorBoard, W&B and MLflow, each read
back from its offline/file store and compared with the run's own files; imported only when
configured; a missing package stops the run before it starts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import chat_rows, make_config, run_cli, serving, tiny_train_args, write_jsonl

from leantune.config.monitor import MlflowConfig, MonitorConfig, WandbConfig
from leantune.config.parse import ConfigError
from leantune.core.signals import SIGNALS, Interrupted
from leantune.monitor.backends import BACKENDS, RunInfo, optional_sinks
from leantune.monitor.events import TrainingPaused, TrainingStopped, read_events
from leantune.monitor.metrics import read_metrics
from leantune.monitor.records import outcome
from leantune.monitor.sinks import ConsoleSink
from leantune.testing.faults import LOSS_SCALE_ENV, SIGNAL_ENV
from leantune.training import recipe
from leantune.training.checks import load_config

SRC = Path(__file__).resolve().parents[3] / "src"
BACKEND_MODULES = ("tensorboard", "wandb", "mlflow")
DASHBOARD_STATIC = SRC / "leantune" / "monitor" / "dashboard" / "static"


def wandb_env(mp: pytest.MonkeyPatch, home: Path) -> None:
    """W&B offline and quiet, its config and caches in `home`: nothing reaches the network or
    the user's ~/.config/wandb."""
    for name, value in {
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
    }.items():
        mp.setenv(name, value)
    mp.delenv("WANDB_MODE", raising=False)
    mp.delenv("WANDB_API_KEY", raising=False)


def monitors(root: Path) -> list[str]:
    return [
        "monitor.tensorboard=true",
        "monitor.wandb.project=leantune-tests",
        "monitor.wandb.mode=offline",
        f"monitor.mlflow.uri=file:{root / 'mlruns'}",
        "monitor.mlflow.experiment=tests",
    ]


def mlflow_client(root: Path) -> Any:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"file:{root / 'mlruns'}")


def run_ids(run: Path) -> dict[str, str]:
    return json.loads((run / "monitor_runs.json").read_text())


def tensorboard_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_runs(run: Path) -> list[list[dict[str, Any]]]:
    """The records of each offline W&B run under <run>/wandb, oldest first, read back from its
    .wandb transaction log with W&B's own reader (`wandb leet inspect --json`)."""
    found = []
    for log in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        out = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        found.append([json.loads(line) for line in out.stdout.splitlines() if line.strip()])
    return found


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def of_kind(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r[kind] for r in records if r["type"] == kind]


# ---------------------------------------------------------------------------------------------
# One run logged to all three, with a periodic eval and a rollback


@pytest.fixture(scope="module")
def monitored(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("monitored")
    train_file = write_jsonl(root / "train.jsonl", chat_rows(24))
    eval_file = write_jsonl(root / "eval.jsonl", chat_rows(4, offset=100))
    run = root / "run"
    with pytest.MonkeyPatch.context() as mp:
        wandb_env(mp, root / "wandb-home")
        mp.setenv(LOSS_SCALE_ENV, "6:50")  # step 6's loss x50: a spike, rolled back to step 4
        cfg = make_config(
            tiny_llama_dir, train_file, run, "data.pack=false", "train.max_steps=8",
            "train.save_every=2", "train.lr=1e-3", "guard.loss_spike=rollback",
            "guard.warmup=3", f"data.eval={eval_file}", "train.eval_every=4", *monitors(root),
        )  # fmt: skip
        recipe.train(cfg, log=lambda _: None)
    yield run


def test_the_monitored_run_rolled_back_once(monitored: Path) -> None:
    kinds = [e["kind"] for e in read_events(monitored / "events.jsonl")]
    assert kinds == ["loss_spike", "rollback"]
    assert [m["step"] for m in read_metrics(monitored / "metrics.jsonl")] == list(range(1, 9))


def test_tensorboard_holds_the_one_trajectory_of_metrics_jsonl(monitored: Path) -> None:
    scalars = tensorboard_scalars(monitored)
    metrics = read_metrics(monitored / "metrics.jsonl")
    # The restart after the rollback purged the rolled-back attempt's step 5.
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        assert scalars[f"train/{key}"] == [
            (m["step"], pytest.approx(m[key], rel=1e-6)) for m in metrics
        ], key
    evals = read_metrics(monitored / "eval.jsonl")
    assert scalars["eval/loss"] == [(e["step"], pytest.approx(e["eval_loss"])) for e in evals]
    # The events survive the purge: the spike at step 6, the rollback (as step 5 starts again).
    assert scalars["events/loss_spike"] == [(6, 1.0)]
    assert scalars["events/rollback"] == [(5, 1.0)]


def test_tensorboard_has_the_config_as_hyper_parameters_and_text(monitored: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(monitored / "tensorboard"))
    acc.Reload()
    assert {"config/text_summary", "events/text_summary", "outcome/text_summary"} <= set(
        acc.Tags()["tensors"]
    )
    (outcome_text,) = acc.Tensors("outcome/text_summary")
    assert outcome_text.tensor_proto.string_val == [b"finished (exit code 0)"]
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert info.hparams["train.lr"].number_value == pytest.approx(1e-3)
    assert info.hparams["method.name"].string_value == "lora"


def test_wandb_offline_history_has_every_record_against_train_step(monitored: Path) -> None:
    (records,) = wandb_runs(monitored)
    (run,) = of_kind(records, "run")
    assert run["project"] == "leantune-tests" and run["display_name"] == monitored.name
    assert run["run_id"] == run_ids(monitored)["wandb"]
    assert run["config"]["update"]["train"]["lr"] == 1e-3
    assert run["config"]["update"]["method"]["name"] == "lora"
    rows = history(records)
    train = [(r["train/step"], r["train/loss"]) for r in rows if "train/loss" in r]
    # W&B history only grows: the rolled-back attempt's step 5 stays, ahead of the new one.
    assert [s for s, _ in train] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    last = dict(train)
    metrics = read_metrics(monitored / "metrics.jsonl")
    assert [last[m["step"]] for m in metrics] == [m["loss"] for m in metrics]
    evals = [(r["train/step"], r["eval/loss"]) for r in rows if "eval/loss" in r]
    assert evals == [(e["step"], e["eval_loss"]) for e in read_metrics(monitored / "eval.jsonl")]
    events = [(r["train/step"], k) for r in rows for k in r if k in ("events/loss_spike",
              "events/rollback")]  # fmt: skip
    assert events == [(6, "events/loss_spike"), (5, "events/rollback")]
    assert any("events/table._type" in r for r in rows)
    assert of_kind(records, "exit")[0]["exit_code"] == 0
    updates = [s["update"] for s in of_kind(records, "summary")]
    assert {"outcome": "finished"} in updates


def test_mlflow_file_store_has_every_record_the_params_and_the_status(monitored: Path) -> None:
    client = mlflow_client(monitored.parent)
    run = client.get_run(run_ids(monitored)["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == monitored.name
    assert run.data.tags["leantune.outcome"] == "finished"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    assert run.data.params["train.lr"] == "0.001" and run.data.params["method.name"] == "lora"
    assert run.data.params["monitor.mlflow.experiment"] == "tests"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2, 3, 4, 5, 5, 6, 7, 8]  # both attempts at step 5
    metrics = read_metrics(monitored / "metrics.jsonl")
    last = {m.step: m.value for m in losses}
    assert [last[m["step"]] for m in metrics] == [pytest.approx(m["loss"]) for m in metrics]
    evals = client.get_metric_history(run.info.run_id, "eval/loss")
    assert [(m.step, m.value) for m in evals] == [
        (e["step"], pytest.approx(e["eval_loss"])) for e in read_metrics(monitored / "eval.jsonl")
    ]
    spikes = client.get_metric_history(run.info.run_id, "events/loss_spike")
    assert [(m.step, m.value) for m in spikes] == [(6, 1.0)]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["events.jsonl"]


# ---------------------------------------------------------------------------------------------
# A preference run's reward metrics (issue 34) in every sink, each equal to metrics.jsonl's

PAIRS = [
    {"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.", "rejected": f"Maybe {i}."}
    for i in range(4)
]
# TRL's names (users compare with TRL): the rewards/accuracy and rewards/margin are
# rewards/accuracies and rewards/margins.
REWARD_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")  # fmt: skip


@pytest.fixture(scope="module")
def preference(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A 3-step DPO run logged to TensorBoard, W&B and MLflow, with its progress bar on; the
    CLI's result (the console) is returned with the run directory."""
    root = tmp_path_factory.mktemp("preference")
    data = write_jsonl(root / "pairs.jsonl", PAIRS)
    run = root / "runs" / "dpo"
    with pytest.MonkeyPatch.context() as mp:
        wandb_env(mp, root / "wandb-home")
        done = run_cli(tiny_train_args(
            tiny_llama_dir, data, run, "train.objective=dpo", "data.max_seq_len=auto",
            "train.max_steps=3", "train.precision=fp32", "method.dropout=0",
            "run.progress=true", *monitors(root),
        ))  # fmt: skip
    assert done.code == 0, done
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(key in r for r in rows for key in REWARD_KEYS)
    assert rows[-1]["rewards/margins"] > 0  # trained: the values are not all zero
    yield run, done


def test_tensorboard_wandb_and_mlflow_hold_the_reward_metrics_of_metrics_jsonl(
    preference: Any,
) -> None:
    run, _ = preference
    rows = read_metrics(run / "metrics.jsonl")
    scalars = tensorboard_scalars(run)
    (records,) = wandb_runs(run)
    wandb_rows = [r for r in history(records) if "train/loss" in r]
    client = mlflow_client(run.parent.parent)
    run_id = run_ids(run)["mlflow"]
    for key in REWARD_KEYS:
        expected = [(r["step"], r[key]) for r in rows]
        assert scalars[f"train/{key}"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in expected]
        assert [(r["train/step"], r[f"train/{key}"]) for r in wandb_rows] == expected, key
        logged = client.get_metric_history(run_id, f"train/{key}")
        assert [(m.step, m.value) for m in logged] == expected, key


def test_the_progress_bar_shows_reward_accuracy_and_margin_in_one_field(
    preference: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _, done = preference
    last = read_metrics(preference[0] / "metrics.jsonl")[-1]
    shown = f"rewards=acc {last['rewards/accuracies']:.0%} margin {last['rewards/margins']:+.3g}"
    final = done.err.split("\r")[-1]  # the bar's last refresh: step 3 of 3
    assert "3/3" in final and shown in final, done.err
    assert "rewards/" not in done.err and "logps" not in done.err  # one field, not six
    # An SFT step has no reward field; a KTO step (no pairs, so no accuracy) its margin alone.
    sink = ConsoleSink(2, True, lambda _: None)
    sink.start(0)
    sink.metrics({"step": 1, "loss": 1.5, "tokens_per_s": 10.0})
    sft = capsys.readouterr().err
    sink.metrics({"step": 2, "loss": 0.5, "tokens_per_s": 10.0, "rewards/margins": -0.25})
    sink.close()
    kto = capsys.readouterr().err.split("\r")[-1]
    assert "loss=1.5000" in sft and "rewards" not in sft
    assert "2/2" in kto and "rewards=margin -0.25" in kto and "acc" not in kto


def test_the_report_and_the_dashboard_of_a_preference_run_chart_its_rewards(
    preference: Any,
) -> None:
    run, _ = preference
    titles = re.findall(r'<img alt="([^"]*)"', (run / "report.html").read_text())
    assert titles[-3:] == ["Reward accuracy", "Rewards", "Log-probs of the answers"]
    # The dashboard's run page charts the fields run.js names, as the metrics series serves
    # them: every one of them is in a DPO run's rows.
    charted = re.findall(r'\["(rewards/\w+)"', (DASHBOARD_STATIC / "run.js").read_text())
    assert sorted(charted) == sorted(REWARD_KEYS[:4])
    with serving(run.parent) as server:
        served = get_json(server.url + "api/runs/dpo/metrics")["rows"]
    assert served == read_metrics(run / "metrics.jsonl")
    assert all(key in row for row in served for key in charted)


# ---------------------------------------------------------------------------------------------
# A stop closes every backend; the resume goes on logging to the same runs


def test_a_signal_closes_every_backend_and_the_resume_continues_their_runs(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb_env(monkeypatch, tmp_path / "wandb-home")
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(20))
    run = tmp_path / "run"
    args = tiny_train_args(
        tiny_llama_dir, data, run, "data.pack=false", "train.max_steps=6", "train.grad_accum=2",
        "train.save_every=0", *monitors(tmp_path),
    )  # fmt: skip
    monkeypatch.setenv(SIGNAL_ENV, "7:TERM")  # after step 4's last micro-batch: stops there
    assert run_cli(args).code == 143
    done = [m["step"] for m in read_metrics(run / "metrics.jsonl")]
    assert done == [1, 2, 3, 4]
    ids = run_ids(run)
    client = mlflow_client(tmp_path)
    stopped = client.get_run(ids["mlflow"])
    assert stopped.info.status == "KILLED"
    assert stopped.data.tags["leantune.outcome"] == "interrupted"
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "train/loss")] == done
    (first,) = wandb_runs(run)
    assert of_kind(first, "exit")[0]["exit_code"] == 143
    assert [r["train/step"] for r in history(first) if "train/loss" in r] == done
    assert [s for s, _ in tensorboard_scalars(run)["train/loss"]] == done

    monkeypatch.delenv(SIGNAL_ENV)
    assert run_cli(args).code == 0
    assert run_ids(run) == ids  # the same W&B and MLflow runs
    metrics = read_metrics(run / "metrics.jsonl")
    finished = client.get_run(ids["mlflow"])
    assert finished.info.status == "FINISHED"
    assert finished.data.tags["leantune.outcome"] == "finished"
    losses = client.get_metric_history(ids["mlflow"], "train/loss")
    assert [(m.step, m.value) for m in losses] == [
        (m["step"], pytest.approx(m["loss"])) for m in metrics
    ]
    first, second = wandb_runs(run)
    assert of_kind(second, "run")[0]["run_id"] == of_kind(first, "run")[0]["run_id"]
    assert [r["train/step"] for r in history(second) if "train/loss" in r] == [5, 6]
    assert of_kind(second, "exit")[0]["exit_code"] == 0
    assert tensorboard_scalars(run)["train/loss"] == [
        (m["step"], pytest.approx(m["loss"], rel=1e-6)) for m in metrics
    ]


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (None, ("finished", 0)),
        (TrainingPaused("paused"), ("paused", 3)),
        (TrainingStopped("stopped"), ("stopped", 4)),
        (Interrupted(15, True), ("interrupted", 143)),
        (RuntimeError("boom"), ("failed", 1)),
    ],
)
def test_a_sink_closing_in_the_loops_finally_knows_how_it_ended(
    raised: Exception | None, expected: tuple[str, int]
) -> None:
    seen = []
    with pytest.raises(type(raised)) if raised is not None else contextlib.nullcontext():
        try:
            if raised is not None:
                raise raised
        finally:
            seen.append(outcome())
    assert seen == [expected]


@pytest.mark.parametrize("signum", SIGNALS)
def test_every_stop_signal_train_handles_ends_as_interrupted(signum: int) -> None:
    """SIGHUP (a dropped ssh session) as SIGINT and SIGTERM: the run stopped with a checkpoint,
    so no backend may call it failed."""
    seen = []
    with pytest.raises(Interrupted):
        try:
            raise Interrupted(signum, True)
        finally:
            seen.append(outcome())
    assert seen == [("interrupted", 128 + signum)]


# ---------------------------------------------------------------------------------------------
# Imported only when configured; a missing package is exit 2 before anything starts


def test_a_plain_run_imports_no_backend_and_a_configured_one_does(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    plain = tiny_train_args(tiny_llama_dir, data, tmp_path / "plain", "train.max_steps=2")
    with_tb = tiny_train_args(
        tiny_llama_dir, data, tmp_path / "tb", "train.max_steps=2", "monitor.tensorboard=true"
    )
    script = textwrap.dedent(
        f"""
        import json, sys
        from leantune.cli.app import main

        def loaded():
            return sorted({{m.split(".")[0] for m in sys.modules}} & set({BACKEND_MODULES!r}))

        codes = [main({plain!r})]
        after_plain = loaded()
        codes.append(main({with_tb!r}))
        print(json.dumps([codes, after_plain, loaded()]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    codes, after_plain, after_tb = json.loads(out.stdout.strip().splitlines()[-1])
    assert codes == [0, 0]
    assert after_plain == []
    assert after_tb == ["tensorboard"]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_missing_package_is_exit_2_naming_the_setting_and_the_extra(
    name: str, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = BACKENDS[name].package
    # As if not installed; what earlier tests imported is imported again, and meets that.
    gone = (f"{package}.", f"leantune.monitor.{name}_sink", "torch.utils.tensorboard")
    for module in [m for m in sys.modules if m.startswith(gone)]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, package, None)
    setting = {
        "tensorboard": "monitor.tensorboard=true",
        "wandb": "monitor.wandb.project=p",
        "mlflow": f"monitor.mlflow.uri=file:{tmp_path / 'mlruns'}",
    }[name]
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    run = tmp_path / "run"
    result = run_cli(tiny_train_args(tiny_llama_dir, data, run, "train.max_steps=2", setting))
    assert result.code == 2
    key = setting.split("=")[0]
    assert f"error: {key}" in result.err and f"pip install 'leantune[{name}]'" in result.err
    assert not run.exists()  # refused before the run directory was claimed
    # The set-up's own import says the same (for a package found but not importable).
    monitor = MonitorConfig(
        tensorboard=name == "tensorboard",
        wandb=WandbConfig(project="p") if name == "wandb" else None,
        mlflow=MlflowConfig(uri="file:/nowhere") if name == "mlflow" else None,
    )
    wanted = rf"{re.escape(BACKENDS[name].setting)} needs the .*leantune\[{name}\]"
    with pytest.raises(ConfigError, match=wanted):
        optional_sinks(monitor, RunInfo(tmp_path, "r", {}))


def test_nested_monitor_sections_from_the_command_line_and_yaml(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(2))
    cfg = load_config(
        None,
        [f"data.train={data}", "monitor.wandb.mode=offline", "monitor.wandb.project=x",
         "monitor.mlflow.uri=file:/m"],
    )  # fmt: skip
    assert cfg.monitor.wandb == WandbConfig(project="x", mode="offline")
    assert cfg.monitor.mlflow == MlflowConfig(uri="file:/m")
    assert load_config(None, [f"data.train={data}"]).monitor.wandb is None
    path = tmp_path / "c.yaml"
    path.write_text(
        f"data: {{train: {data}}}\nmonitor:\n  mlflow: {{uri: file:/m, experiment: e}}\n"
    )
    assert load_config(path).monitor.mlflow == MlflowConfig(uri="file:/m", experiment="e")
    path.write_text(f"data: {{train: {data}}}\nmonitor:\n  wandb:\n    projekt: x\n")
    result = run_cli(["validate", str(path)])
    assert result.code == 2 and "c.yaml:3: monitor.wandb: unknown key(s) projekt" in result.err
    for override, message in [
        ("monitor.wandb.projekt=x", "monitor.wandb.projekt: unknown field; valid: project,"),
        ("monitor.wandb.mode=online", "monitor.wandb.project: required"),
        ("monitor.mlflow.experiment=e", "monitor.mlflow.uri: required"),
        ("monitor.wandb.mode=sometimes", "monitor.wandb.mode: 'sometimes' is not one of"),
        ("monitor.tensorboard.dir=x", "monitor.tensorboard.dir: unknown key"),
        ("model.rope_scaling.factor=4", "model.rope_scaling.factor: its section is unset"),
    ]:
        result = run_cli(["validate", f"data.train={data}", override])
        assert result.code == 2 and message in result.err, (override, result)
    # The other sections keep their section.field keys, and section.field.sub is refused there.
    assert run_cli(["validate", f"data.train={data}", "train.lr.x=1"]).code == 2
