"""The step's fault hooks: the library reads no LEANTUNE_* fault variable, the `leantune` entry
installs the hooks that do (`testing.faults`), and each fault fires where and as often as set."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from leantune.cli.app import main
from leantune.testing import faults
from leantune.testing.faults import EnvFaults
from leantune.training import hooks
from leantune.training.hooks import NoStepHooks, StepHooks, new_step_hooks

SRC = Path(__file__).resolve().parents[3] / "src" / "leantune"
FAULT_VARIABLES = [getattr(faults, name) for name in dir(faults) if name.endswith("_ENV")]


def test_only_the_testing_package_names_the_fault_variables() -> None:
    assert len(FAULT_VARIABLES) == 7
    naming = sorted(
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if any(v in p.read_text(encoding="utf-8") for v in FAULT_VARIABLES)
    )
    assert naming == ["testing/faults.py"]


def test_the_library_runs_without_faults_and_the_cli_entry_installs_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(hooks, "_factory", NoStepHooks)  # as a library user's process starts
    monkeypatch.setenv(faults.OOM_STEP_ENV, "1")
    library = new_step_hooks()
    library.check_memory(1, 0, 1)  # the variable is set, and nothing happens
    assert library.window_loss(1, 2.0, []) == 2.0
    assert main(["validate", "--help-fields"]) == 0
    capsys.readouterr()
    assert isinstance(new_step_hooks(), EnvFaults)


def test_each_fault_fires_where_and_as_often_as_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.OOM_STEP_ENV, "3")
    monkeypatch.setenv(faults.OOM_EVAL_ENV, "2")
    monkeypatch.setenv(faults.LOSS_SCALE_ENV, "2:10")
    run: StepHooks = EnvFaults()
    run.check_memory(3, 0, 2)  # not the step's last micro-batch
    run.check_memory(2, 1, 2)  # not the step
    with pytest.raises(torch.OutOfMemoryError, match="LEANTUNE_OOM_AT_STEP=3"):
        run.check_memory(3, 1, 2)
    run.check_memory(3, 1, 2)  # once: the replay goes through
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError, match="LEANTUNE_OOM_IN_EVAL"):
            run.before_eval()
    run.before_eval()
    weight = nn.Parameter(torch.ones(2))
    weight.grad = torch.full((2,), 0.5)
    assert run.window_loss(1, 1.5, [weight]) == 1.5
    assert run.window_loss(2, 1.5, [weight]) == 15.0
    assert weight.grad.tolist() == [5.0, 5.0]
    assert run.window_loss(2, 1.5, [weight]) == 1.5 and weight.grad.tolist() == [5.0, 5.0]


def test_a_fault_for_another_rank_leaves_this_one_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.FAULT_RANK_ENV, "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(faults.OOM_STEP_ENV, "1")
    monkeypatch.setenv(faults.KILL_ENV, "0")
    run = EnvFaults()
    run.check_memory(1, 0, 1)
    run.after_backward(0)  # no SIGKILL: rank 1's
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart: the kill is spent
    assert EnvFaults().kill_at is None and EnvFaults().oom_step == 1


def test_the_signals_go_to_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _: received.append(signum))
    try:
        monkeypatch.setenv(faults.SIGNAL_ENV, "5:USR1")
        monkeypatch.setenv(faults.START_SIGNAL_ENV, "USR1")
        run = EnvFaults()
        run.after_backward(4)
        assert received == []
        run.at_start()
        run.after_backward(5)
        assert received == [signal.SIGUSR1, signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)
