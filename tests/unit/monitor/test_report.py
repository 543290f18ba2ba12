"""The run report: report.html at the end of every run and from
`leantune report RUN_DIR`, self-contained, built from the run directory's files only."""

from __future__ import annotations

import base64
import io
import json
import re
import time
from pathlib import Path

import pytest
import yaml
from matplotlib.figure import Figure
from PIL import Image
from support import chat_rows, run_cli, tiny_train_args, write_jsonl

from leantune.config import Config, to_dict
from leantune.monitor.events import EXIT_PAUSED
from leantune.monitor.metrics import read_metrics
from leantune.monitor.report import write_report
from leantune.monitor.report_data import read_run
from leantune.monitor.report_plots import charts
from leantune.testing.faults import LOSS_SCALE_ENV

IMG = re.compile(r'<img alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')
GENERATED = re.compile(r'<p class="muted" id="generated">[^<]*</p>')


def images(text: str) -> list[tuple[str, Image.Image]]:
    """Each embedded chart's title and decoded image."""
    found = []
    for title, data in IMG.findall(text):
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        image.load()  # decodes the whole PNG
        found.append((title, image))
    return found


def assert_self_contained(text: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", text, re.I)
    assert "<script" not in text and "<link" not in text and "url(" not in text


def test_a_paused_then_finished_run_has_a_report_each_time(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [json.dumps(r) for r in chat_rows(24)]
    rows.insert(4, '{"messages": "not a list"}')  # line 5: a bad line
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    evals = write_jsonl(tmp_path / "eval.jsonl", chat_rows(4, offset=100))
    run = tmp_path / "run"
    args = tiny_train_args(
        tiny_llama_dir, train, run, f"data.eval={evals}", "train.eval_exact_match=true",
        "train.max_new_tokens=8", "train.max_steps=7", "train.lr=1e-3", "guard.grad_norm=pause",
        "guard.warmup=3",
    )  # fmt: skip
    monkeypatch.setenv(LOSS_SCALE_ENV, "5:50")  # step 5's gradients x50: the guard pauses
    assert run_cli(args).code == EXIT_PAUSED
    paused = (run / "report.html").read_text()
    assert "Status: paused by the guard at step 5 (grad_norm): loss " in paused
    assert "<td>grad_norm</td><td>pause</td>" in paused
    assert len(images(paused)) == 5
    assert "No summary.json yet" in paused and "Last step 4" in paused

    monkeypatch.delenv(LOSS_SCALE_ENV)
    assert run_cli(args).code == 0
    text = (run / "report.html").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert "Status: finished" in text
    assert "<th>method</th><td>lora</td>" in text
    assert (
        f'<th>final_train_loss</th><td class="num">{summary["final_train_loss"]:.4g}</td>' in text
    )
    trainable = f"{summary['trainable_params']:,} of {summary['total_params']:,} parameters"
    assert trainable in text
    before, after = summary["base_exact_match"], summary["eval_exact_match"]
    assert f"before {before:.1%} &rarr; after {after:.1%}" in text
    # The guard's events, as events.jsonl holds them: flagged, paused, resumed.
    kinds = re.findall(r"<tr><td class=\"num\">\d+</td><td>[^<]*</td><td>(\w+)</td>", text)
    assert kinds == ["grad_norm", "pause", "resume"]
    # The bad line, where it is and why; the data report's counts.
    assert f"<td>{train}:5</td>" in text
    assert '<th>bad lines</th><td class="num">1</td>' in text
    assert '<th>kept</th><td class="num">24</td>' in text
    charts = images(text)
    assert [t for t, _ in charts] == [
        "Loss",
        "Learning rate",
        "Gradient norm (before clipping)",
        "Throughput",
        "Memory vs plan",
    ]  # fmt: skip  (the run wrote the planner's peak: memory_plan.json)
    assert json.loads((run / "memory_plan.json").read_text())["peak_bytes"] > 0
    assert all(image.format == "PNG" and image.size[0] > 300 for _, image in charts)
    assert_self_contained(text)

    # `leantune report` rebuilds the same file (but for when it was generated).
    assert run_cli(["report", str(run)]).code == 0
    rebuilt = (run / "report.html").read_text()
    assert GENERATED.sub("", rebuilt) == GENERATED.sub("", text)
    assert len(GENERATED.findall(text)) == 1
    elsewhere = tmp_path / "copy.html"
    assert run_cli(["report", str(run), "--out", str(elsewhere)]).code == 0
    assert GENERATED.sub("", elsewhere.read_text()) == GENERATED.sub("", text)


def test_monitor_report_false_writes_none(tiny_llama_dir: Path, tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    run = tmp_path / "run"
    args = tiny_train_args(tiny_llama_dir, train, run, "train.max_steps=1", "monitor.report=false")
    assert run_cli(args).code == 0
    assert (run / "summary.json").is_file() and not (run / "report.html").exists()


def test_report_of_something_that_is_not_a_run_is_exit_2_naming_it(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    for path in (tmp_path / "folder", tmp_path / "missing"):
        result = run_cli(["report", str(path)])
        assert result.code == 2 and f"error: {path}: not a leantune run directory" in result.err
        assert not (path / "report.html").exists()


def test_a_run_with_no_metrics_yet_still_gets_a_report(tmp_path: Path) -> None:
    (tmp_path / "leantune_run.json").write_text("{}")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(Config())))
    text = write_report(tmp_path).read_text()
    assert "No metrics yet" in text and "No summary.json yet" in text
    assert images(text) == [] and "Status: in progress" in text
    assert "<th>method</th><td>lora</td>" in text


def synthetic_run(path: Path, steps: int) -> Path:
    """A finished run's files as a demo-sized run writes them (no model, no training)."""
    cfg = to_dict(Config())
    cfg["train"].update(max_steps=steps, memory_budget="2GiB")
    cfg["data"]["max_seq_len"] = 512
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    (path / "leantune_run.json").write_text(json.dumps({"fingerprint": {"train.global_batch": 8}}))
    metrics = [
        {
            "step": s, "loss": 2.0 / (1 + s / 100), "lr": 2e-4 * min(1, s / 50),
            "grad_norm": 0.5 + (s % 7) / 10, "tokens": 3000 + s % 500, "supervised_tokens": 900,
            "tokens_per_s": 1500.0 + s % 100, "step_time_s": 2.1 + (s % 5) / 10,
            "rss_bytes": 2**30 + s * 2**18, "peak_mem_bytes": 2**30 + s * 2**18,
            "optimizer_stepped": True, "micro_batch_size": 4, "grad_accum": 2,
        }
        for s in range(1, steps + 1)
    ]  # fmt: skip
    write_jsonl(path / "metrics.jsonl", metrics)
    write_jsonl(path / "eval.jsonl", [{"step": s, "eval_loss": 2.2 / (1 + s / 100)}
                                      for s in range(100, steps + 1, 100)])  # fmt: skip
    events = [
        {"time": 1.7e9, "step": 300, "kind": "loss_spike", "message": "spike", "action": "warn"},
        {"time": 1.7e9 + 9, "step": 500, "kind": "oom", "message": "micro-batch 8 -> 4"},
        {"time": 1.7e9 + 20, "step": 700, "kind": "rollback", "message": "restored step 600"},
    ]
    write_jsonl(path / "events.jsonl", events)
    summary = {"steps": steps, "train_time_s": 2300.0, "trainable_params": 1000,
               "total_params": 100000, "final_train_loss": metrics[-1]["loss"]}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "memory_plan.json").write_text(json.dumps({"peak_bytes": 2**31 - 2**29}))
    return path


def test_the_report_of_a_demo_sized_run_is_quick_and_shows_memory_against_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = synthetic_run(tmp_path / "run", 1000)
    started = time.perf_counter()
    text = write_report(run).read_text()
    took = time.perf_counter() - started
    with capsys.disabled():
        print(f"\nreport of 1000 steps: {took:.2f} s, {len(text) / 1024:.0f} KiB")
    charts = images(text)
    assert [t for t, _ in charts][-1] == "Memory vs plan" and len(charts) == 5
    assert "Status: finished" in text and "<td>rollback</td>" in text and "<td>oom</td>" in text
    assert "Rows trained: 79.3%" in text  # a mean 3249.5 tokens / (8 rows x 512)
    assert "<th>trainable</th><td>1,000 of 100,000 parameters (1.000%)</td>" in text
    assert_self_contained(text)


# A preference run's reward metrics (issue 34; TRL's names): the chart and line of each.
REWARD_LINES = {
    "rewards/accuracies": ("Reward accuracy", None),  # the chart's only line
    "rewards/chosen": ("Rewards", "chosen"),
    "rewards/rejected": ("Rewards", "rejected"),
    "rewards/margins": ("Rewards", "margin (chosen - rejected)"),
    "logps/chosen": ("Log-probs of the answers", "chosen"),
    "logps/rejected": ("Log-probs of the answers", "rejected"),
}


def preference_run(path: Path, steps: int) -> Path:
    """`synthetic_run` with a DPO run's reward metrics on every step."""
    run = synthetic_run(path, steps)
    rows = read_metrics(run / "metrics.jsonl")
    for r in rows:
        s = r["step"]
        chosen, rejected = 0.01 * s, -0.02 * s + (s % 3) / 50
        r.update({"rewards/chosen": chosen, "rewards/rejected": rejected,
                  "rewards/accuracies": min(1.0, 0.5 + s / 40),
                  "rewards/margins": chosen - rejected, "logps/chosen": -20.0 + s / 10,
                  "logps/rejected": -25.0 - s / 10})  # fmt: skip
    write_jsonl(run / "metrics.jsonl", rows)
    return run


def test_a_preference_runs_report_plots_each_reward_metric_in_its_chart(tmp_path: Path) -> None:
    run = preference_run(tmp_path / "run", 20)
    text = write_report(run).read_text()
    titles = [t for t, _ in images(text)]
    assert titles == ["Loss", "Learning rate", "Gradient norm (before clipping)", "Throughput",
                      "Memory vs plan", "Reward accuracy", "Rewards",
                      "Log-probs of the answers"]  # fmt: skip
    assert_self_contained(text)
    # What each chart draws, read back from its axes: every reward metric, step by step, as
    # metrics.jsonl holds it, in the chart and under the label the table above says.
    drawn: dict[tuple[str, str | None], list[tuple[float, float]]] = {}
    for chart in charts(read_run(run)):
        ax = Figure().add_subplot()
        chart.draw(ax)
        lines = ax.get_lines()
        for line in lines:
            label = None if len(lines) == 1 else str(line.get_label())
            drawn[chart.title, label] = [(x, y) for x, y in line.get_xydata()]
    rows = read_metrics(run / "metrics.jsonl")
    for key, where in REWARD_LINES.items():
        assert drawn[where] == [(r["step"], r[key]) for r in rows], key
