"""The stability guard: the pure decision function, and the loop carrying out its actions."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from support import make_config, prepare_rows

from leantune.cli.app import main
from leantune.config import GuardConfig
from leantune.core.optim import warmup_cosine
from leantune.data.loader import SampleStream
from leantune.monitor.events import (
    EXIT_GUARD_STOPPED,
    EXIT_PAUSED,
    TrainingStopped,
    read_events,
)
from leantune.monitor.metrics import read_metrics
from leantune.monitor.step_stats import TIMING_FIELDS
from leantune.testing.faults import LOSS_SCALE_ENV
from leantune.training import build, recipe
from leantune.training.guard import actions as guard_actions
from leantune.training.guard.detect import Decision, GuardHistory, GuardSettings, decide, remember
from leantune.training.run_setup import guard_settings
from leantune.training.state.checkpoint import latest_checkpoint, load_checkpoint

DATA = Path(__file__).resolve().parents[2] / "data"


def settings(**changes: Any) -> GuardSettings:
    """The configured defaults (config.GuardConfig) with some fields changed."""
    return replace(guard_settings(GuardConfig()), **changes)


def feed(series: list[tuple[float, float]], s: GuardSettings) -> list[tuple[int, Decision]]:
    """Run the guard over (loss, grad_norm) pairs; the flagged steps and their decisions."""
    history, flagged = GuardHistory(), []
    for i, (loss, norm) in enumerate(series):
        d = decide(history, loss, norm, s)
        if d.action != "step":
            flagged.append((i, d))
        history = remember(history, loss, norm, d, s.window)
    return flagged


def steady(n: int, seed: int = 0, noise: float = 0.1) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    return [
        (1.0 * math.exp(rng.gauss(0, noise)), 0.5 * math.exp(rng.gauss(0, noise))) for _ in range(n)
    ]


# --------------------------------------------------------------------------------------------
# The pure function


@pytest.mark.parametrize("loss,norm", [(math.nan, 1.0), (1.0, math.inf), (math.inf, math.nan)])
def test_nonfinite_is_caught_from_the_first_step(loss: float, norm: float) -> None:
    d = decide(GuardHistory(), loss, norm, settings())
    assert (d.action, d.detector) == ("skip", "nonfinite")
    assert decide(GuardHistory(), loss, norm, settings(nonfinite="pause")).action == "pause"


def test_consecutive_skips_turn_into_stop_at_the_limit() -> None:
    s = settings(max_consecutive_skips=3)
    h = GuardHistory()
    actions = []
    for _ in range(3):
        d = decide(h, math.nan, 1.0, s)
        actions.append(d.action)
        h = remember(h, math.nan, 1.0, d, s.window)
    assert actions == ["skip", "skip", "stop"]
    assert "3 consecutive steps skipped" in decide(GuardHistory((), (), 2), math.nan, 1, s).reason
    # An applied step ends the run of skips.
    h = remember(GuardHistory((), (), 2), 1.0, 1.0, Decision("step"), 8)
    assert h.consecutive_skips == 0 and decide(h, math.nan, 1.0, s).action == "skip"


def test_spike_detectors_wait_for_the_warmup() -> None:
    s = settings(warmup=20, loss_spike="skip")
    before = feed([*steady(19), (50.0, 0.5)], s)
    after = feed([*steady(20), (50.0, 0.5)], s)
    assert before == []
    assert [(i, d.action, d.detector) for i, d in after] == [(20, "skip", "loss_spike")]
    assert after[0][1].details["ratio"] == pytest.approx(50, rel=0.2)


def test_loss_spike_threshold_is_sigmas_above_the_median_with_a_ratio_floor() -> None:
    s = settings(loss_spike="warn", grad_norm="off")
    calm = steady(40, noise=0.01)  # MAD tiny: the 3x floor decides
    assert feed([*calm, (2.9, 0.5)], s) == []
    assert [i for i, _ in feed([*calm, (3.1, 0.5)], s)] == [40]
    noisy = steady(40, noise=0.4)  # 6 robust sigmas of a 0.4 log-noise is ~11x
    assert feed([*noisy, (5.0, 0.5)], s) == []
    assert [d.detector for _, d in feed([*noisy, (30.0, 0.5)], s)] == ["loss_spike"]


def test_grad_norm_anomaly_has_its_own_action_and_off_means_off() -> None:
    series = [*steady(30), (1.0, 40.0)]
    hit = feed(series, settings(grad_norm="rollback"))
    assert [(i, d.action, d.detector) for i, d in hit] == [(30, "rollback", "grad_norm")]
    assert feed(series, settings(grad_norm="off")) == []


def test_falling_loss_and_noisy_normal_series_raise_nothing() -> None:
    rng = random.Random(7)
    series = []
    for t in range(2000):  # a fast fall, then heavy multiplicative noise, a slow norm drift
        loss = (0.05 + 3 * math.exp(-t / 40)) * math.exp(rng.gauss(0, 0.3))
        norm = (0.2 + 0.5 * t / 2000) * math.exp(rng.gauss(0, 0.3))
        series.append((loss, norm))
    assert feed(series, settings(warmup=10)) == []
    halving = [(2.0 * 0.5**t, 1.0) for t in range(60)]
    assert feed(halving, settings(warmup=5)) == []


def test_real_demo_trajectories_raise_nothing() -> None:
    data = json.loads((DATA / "demo_trajectories.json").read_text())
    assert len(data["runs"]) == 4
    for run in data["runs"]:
        series = list(zip(run["loss"], run["grad_norm"], strict=True))
        assert len(series) >= 80
        for warmup in (5, 20):  # also with a short warm-up, while the loss still falls fast
            assert feed(series, settings(warmup=warmup)) == [], run["name"]


def test_history_is_a_bounded_window_and_round_trips_through_json() -> None:
    s = settings(window=4)
    h = GuardHistory()
    for i, (loss, norm) in enumerate(steady(10)):
        h = remember(h, loss, norm, Decision("warn" if i == 3 else "step"), s.window)
    assert len(h.losses) == 4 and h.losses[-1] == steady(10)[-1][0]
    assert remember(h, 9.0, 9.0, Decision("skip"), 4).losses == h.losses  # skipped: not learned
    again = GuardHistory.from_json(json.loads(json.dumps(h.to_json())))
    assert again == h


# --------------------------------------------------------------------------------------------
# The loop carrying out the decisions (tiny Llama, LoRA)


def snapshot(tr: recipe.Trainer) -> dict[str, Any]:
    return {
        "weights": {n: p.detach().clone() for n, p in tr.params.items()},
        "adam": {
            k: {n: v.clone() for n, v in st.items()}
            for k, st in tr.optimizer.state_dict()["state"].items()
        },
        "sched": tr.scheduler.last_epoch,
        "lr": [g["lr"] for g in tr.optimizer.param_groups],
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
        and a["adam"].keys() == b["adam"].keys()
        and all(
            torch.equal(a["adam"][k][n], b["adam"][k][n]) for k in a["adam"] for n in a["adam"][k]
        )
        and a["sched"] == b["sched"]
    )


@pytest.fixture()
def spy_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, dict, recipe.StepResult]]:
    """Every train_step call: the trainer state before, after, and its result."""
    calls: list[tuple[dict, dict, recipe.StepResult]] = []
    original = recipe.train_step

    def spy(tr: recipe.Trainer, *args: Any, **kwargs: Any) -> recipe.StepResult:
        before = snapshot(tr)
        result = original(tr, *args, **kwargs)
        calls.append((before, snapshot(tr), result))
        return result

    monkeypatch.setattr(recipe, "train_step", spy)
    return calls


def nan_grad_on_backwards(monkeypatch: pytest.MonkeyPatch, which: set[int] | None) -> None:
    """Make the gradient of one LoRA weight NaN on the given backward passes (None: all but the
    first)."""
    original = build.apply_method
    count = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        bad = count[0] in which if which is not None else count[0] > 1
        return grad * math.nan if bad else grad

    def apply(model: torch.nn.Module, method_cfg: Any) -> torch.nn.Module:
        model = original(model, method_cfg)
        next(p for n, p in model.named_parameters() if "lora_A" in n).register_hook(hook)
        return model

    monkeypatch.setattr(build, "apply_method", apply)


def test_nan_gradient_skips_the_update_without_advancing_the_schedule(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
    monkeypatch,
    spy_steps,
) -> None:
    nan_grad_on_backwards(monkeypatch, {3})
    run = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir,
        chat_files[0],
        run,
        "data.pack=false",
        "train.max_steps=4",
        "train.warmup_ratio=0.5",
    )
    recipe.train(cfg, log=lambda _: None)
    assert len(spy_steps) == 5  # 4 updates + the skipped window
    before, after, skipped = spy_steps[2]
    assert (skipped.decision.action, skipped.decision.detector) == ("skip", "nonfinite")
    assert same(before, after)  # weights, Adam moments and schedule untouched
    assert not same(*spy_steps[1][:2]) and not same(*spy_steps[3][:2])
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # The LR follows the schedule by applied updates: the skip did not advance it.
    assert [m["lr"] for m in metrics] == [1e-2 * warmup_cosine(s, 4, 2, 0.1) for s in range(4)]
    events = read_events(run / "events.jsonl")
    assert [(e["kind"], e["action"], e["step"]) for e in events] == [("nonfinite", "skip", 3)]
    assert events[0]["rows"] == SampleStream(24, 3).rows(4, 2)


def test_consecutive_nan_stops_with_a_checkpoint_and_exit_code(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
    monkeypatch,
    capsys,
) -> None:
    nan_grad_on_backwards(monkeypatch, None)
    run = tmp_path / "run"
    args = [
        f"model.path={tiny_llama_dir}", f"data.train={chat_files[0]}", "data.eval=null",
        "data.max_seq_len=128", "train.eval_exact_match=false", "train.micro_batch_size=2",
        "train.max_steps=6", "guard.max_consecutive_skips=3", f"run.dir={run}",
        "run.progress=false",
    ]  # fmt: skip
    assert main(["train", *args]) == EXIT_GUARD_STOPPED
    err = capsys.readouterr().err
    assert "3 consecutive steps skipped" in err
    assert "command resumes from it" in err and "diverged" not in err  # the weights are finite
    # A changed train.lr is another trajectory: resume refuses it without force.
    assert "run.resume=force" in err
    kinds = [(e["kind"], e.get("action")) for e in read_events(run / "events.jsonl")]
    assert kinds == [
        ("nonfinite", "skip"),
        ("nonfinite", "skip"),
        ("nonfinite", "stop"),
        ("stop", None),
    ]
    ckpt = load_checkpoint(latest_checkpoint(run / "checkpoints"))  # type: ignore[arg-type]
    assert ckpt.state.step == 1 and ckpt.state.extra["batching"]["samples_seen"] == 4 * 2
    with pytest.raises(TrainingStopped):  # the limit holds in-process too
        recipe.train(
            make_config(
                tiny_llama_dir, chat_files[0], tmp_path / "r2", "guard.max_consecutive_skips=2"
            ),
            log=lambda _: None,
        )


def test_loss_spike_rollback_restores_the_checkpoint_exactly(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
    monkeypatch,
) -> None:
    monkeypatch.setenv(LOSS_SCALE_ENV, "6:50")
    rolled: list[tuple[dict, dict]] = []
    original = guard_actions.rollback

    def spy(tr: recipe.Trainer, bad_end: int, lr_factor: float) -> None:
        path = latest_checkpoint(tr.files.ckpt_dir)
        assert path is not None
        original(tr, bad_end, lr_factor)
        info = {"path": path, "ckpt": load_checkpoint(path), "rng": torch.get_rng_state()}
        rolled.append((snapshot(tr), {**info, "bad_end": bad_end}))

    monkeypatch.setattr(guard_actions, "rollback", spy)
    run = tmp_path / "run"
    common = ["data.pack=false", "train.max_steps=8", "train.save_every=2", "train.lr=1e-3",
              "guard.loss_spike=rollback", "guard.warmup=3"]  # fmt: skip
    cfg = make_config(tiny_llama_dir, chat_files[0], run, *common)
    recipe.train(cfg, log=lambda _: None)

    assert len(rolled) == 1
    state, info = rolled[0]
    ckpt = info["ckpt"]
    assert info["path"].name == "step-000004" and ckpt.state.step == 4
    assert all(torch.equal(state["weights"][n], w) for n, w in ckpt.weights.items())
    adam = ckpt.optimizer["state"]
    assert all(torch.equal(state["adam"][k][n], v) for k in adam for n, v in adam[k].items())
    assert state["sched"] == ckpt.scheduler["last_epoch"]
    assert torch.equal(info["rng"], ckpt.rng["torch"])
    assert state["lr"] == [g["lr"] * 0.5 for g in ckpt.optimizer["param_groups"]]
    # The skipped window: from the checkpoint's position through the spiked step 6.
    events = read_events(run / "events.jsonl")
    assert [(e["kind"], e.get("action")) for e in events] == [
        ("loss_spike", "rollback"),
        ("rollback", None),
    ]
    assert events[0]["step"] == 6 and events[0]["ratio"] > 20
    skipped = SampleStream(24, 3).rows(4 * 2, 2 * 2)
    assert events[1]["skipped_rows"] == skipped and info["bad_end"] == 6 * 2
    assert events[1]["skipped_lines"] == [r + 1 for r in skipped]  # pack=false: row i is line i+1
    # The run carried on from step 4 at half the learning rate, and the LR scale persists.
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    warmup = round(8 * 0.1)
    assert metrics[4]["lr"] == pytest.approx(0.5 * 1e-3 * warmup_cosine(4, 8, warmup, 0.1))
    final = load_checkpoint(run / "checkpoints" / "step-000008")
    assert final.state.extra["lr_scale"] == 0.5 and final.state.extra["rollbacks"] == 1
    assert final.scheduler["base_lrs"] == [0.5 * 1e-3] * len(final.scheduler["base_lrs"])
    assert final.state.extra["batching"]["samples_seen"] == (8 + 2) * 2
    # Resuming after the rollback reproduces the rest of the run exactly.
    first = read_metrics(run / "metrics.jsonl")
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-000008")
    recipe.train(make_config(tiny_llama_dir, chat_files[0], run, *common), log=lambda _: None)
    assert read_metrics(run / "metrics.jsonl") == [
        {**m, **{k: n[k] for k in TIMING_FIELDS if k in n}}
        for m, n in zip(first, read_metrics(run / "metrics.jsonl"), strict=True)
    ]


def test_pause_exits_with_a_marker_and_the_same_command_resumes(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
    monkeypatch,
    capsys,
) -> None:
    run = tmp_path / "run"
    args = [
        "train", f"model.path={tiny_llama_dir}", f"data.train={chat_files[0]}", "data.eval=null",
        "data.max_seq_len=128", "train.eval_exact_match=false", "train.micro_batch_size=2",
        "train.max_steps=7", "train.lr=1e-3", "guard.grad_norm=pause", "guard.warmup=3",
        f"run.dir={run}", "run.progress=false",
    ]  # fmt: skip
    monkeypatch.setenv(LOSS_SCALE_ENV, "5:50")
    assert main(args) == EXIT_PAUSED
    assert "training paused at step 5" in capsys.readouterr().err
    marker = json.loads((run / "PAUSED").read_text())
    assert (
        marker["step"] == 5 and marker["detector"] == "grad_norm" and "median" in marker["reason"]
    )
    ckpt = load_checkpoint(latest_checkpoint(run / "checkpoints"))  # type: ignore[arg-type]
    assert ckpt.state.step == 4 and ckpt.state.extra["batching"]["samples_seen"] == 5 * 2

    monkeypatch.delenv(LOSS_SCALE_ENV)
    assert main(args) == 0
    assert not (run / "PAUSED").exists()
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == list(range(1, 8))
    kinds = [e["kind"] for e in read_events(run / "events.jsonl")]
    assert kinds == ["grad_norm", "pause", "resume"]
    final = load_checkpoint(latest_checkpoint(run / "checkpoints"))  # type: ignore[arg-type]
    assert final.state.step == 7 and final.state.extra["batching"]["samples_seen"] == 8 * 2


def test_a_clean_run_records_no_guard_event(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir, chat_files[0], run, "train.max_steps=16", "train.lr=1e-3",
        "guard.warmup=3", "guard.loss_spike=pause", "guard.grad_norm=pause",
    )  # fmt: skip
    recipe.train(cfg, log=lambda _: None)
    assert len(read_metrics(run / "metrics.jsonl")) == 16
    assert not (run / "events.jsonl").exists()


def test_when_both_detectors_fire_the_severer_action_wins() -> None:
    series = [*steady(30), (50.0, 40.0)]
    s = settings(loss_spike="warn", grad_norm="pause")
    ((i, d),) = feed(series, s)
    assert (i, d.action, d.detector) == (30, "pause", "grad_norm")
    assert "loss 50" in d.reason and "gradient norm 40" in d.reason
    ((_, d),) = feed(series, settings(loss_spike="rollback", grad_norm="skip"))
    assert (d.action, d.detector) == ("rollback", "loss_spike")


def test_loss_scaler_overflow_is_not_a_guard_event_but_a_nonfinite_loss_is(
    tiny_llama_dir: Path, chat_files, tmp_path: Path, monkeypatch, spy_steps
) -> None:
    # The fp16 path on CPU: a real GradScaler (CUDA-only in make_grad_scaler) over fp32 math.
    scalers: list[torch.amp.GradScaler] = []

    def cpu_scaler(precision: str, device_type: str) -> torch.amp.GradScaler:
        scalers.append(torch.amp.GradScaler("cpu", init_scale=1024.0))
        return scalers[-1]

    monkeypatch.setattr(build, "make_grad_scaler", cpu_scaler)
    nan_grad_on_backwards(monkeypatch, {3})  # finite loss, NaN gradient: a scaler overflow
    monkeypatch.setenv(LOSS_SCALE_ENV, "4:inf")  # non-finite loss: the guard's business
    run = tmp_path / "run"
    cfg = make_config(tiny_llama_dir, chat_files[0], run, "data.pack=false", "train.max_steps=5")
    recipe.train(cfg, log=lambda _: None)
    decisions = [
        (r.record["step"], r.decision.action, r.record["optimizer_stepped"]) for *_, r in spy_steps
    ]
    assert decisions == [
        (1, "step", True), (2, "step", True), (3, "step", False),  # the scaler skipped step 3
        (4, "skip", False), (4, "step", True), (5, "step", True),
    ]  # fmt: skip
    assert same(*spy_steps[2][:2]) and same(*spy_steps[3][:2])  # neither moved the weights
    # Halved by the overflow, and again by the skipped step's update(): its gradients were
    # infinite too, and update() must close every unscale_ for the next step to run.
    assert scalers[0].get_scale() == 256.0
    events = read_events(run / "events.jsonl")
    assert [(e["kind"], e["action"], e["step"]) for e in events] == [("nonfinite", "skip", 4)]
    assert [m["optimizer_stepped"] for m in read_metrics(run / "metrics.jsonl")] == [
        True, True, False, True, True
    ]  # fmt: skip


@pytest.mark.parametrize("pack", [True, False])
def test_rows_name_their_examples_so_events_can_cite_source_lines(
    tokenizer, chat_files, pack: bool
) -> None:
    data = prepare_rows(chat_files[0], "chat", tokenizer, 128, pack=pack)
    assert len(data.rows) < 24 if pack else len(data.rows) == 24
    for row in data.rows:
        assert row.input_ids == [t for e in row.examples for t in data.examples[e].input_ids]
    lines = guard_actions.source_lines(data, list(range(len(data.rows))))
    assert sorted(lines) == list(range(1, 25))  # every line exactly once
