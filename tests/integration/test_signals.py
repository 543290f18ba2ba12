"""SIGTERM, SIGINT and SIGHUP: a checkpoint of the last applied step, exit 143 / 130 / 129,
exact resume.

The signals are real: the fault hook LEANTUNE_SIGNAL_AT_MICRO_BATCH=k:SIG makes the training
process send SIG to itself right after the backward of global micro-batch k, so the test knows
which step is in flight without timing anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import run_cli, tiny_train_args, write_jsonl

from leantune.core.signals import Interrupted, StopSignals
from leantune.monitor.metrics import read_metrics

SRC = Path(__file__).resolve().parents[2] / "src"
SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_MICRO_BATCH"
START_ENV = "LEANTUNE_SIGNAL_AT_START"


def chat_rows(n: int) -> list[dict]:
    items = ["lamp", "desk", "phone", "cable"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Order {i}: a {items[i % 4]}. Status?"},
                {"role": "assistant", "content": json.dumps({"item": items[i % 4], "id": i})},
            ]
        }
        for i in range(n)
    ]


def common(model: Path, data: Path) -> list[str]:
    """Without the leading "train" (`leantune` adds it)."""
    return tiny_train_args(
        model, data, None,
        "train.max_steps=6",
        "train.grad_accum=2",
        "train.save_every=0",  # only the final checkpoint: any other one comes from the signal
        "method.dropout=0.1",  # the RNG matters
    )[1:]  # fmt: skip


def leantune(args: list[str], env_extra: dict[str, str] | None = None):
    env = {**os.environ, "PYTHONPATH": str(SRC), **(env_extra or {})}
    for name in (SIGNAL_ENV, START_ENV):
        if name not in (env_extra or {}):
            env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "leantune", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("signals") / "train.jsonl", chat_rows(20))


@pytest.fixture(scope="module")
def straight(tiny_llama_dir: Path, data_file: Path) -> Path:
    run = data_file.parent / "straight"
    done = leantune([*common(tiny_llama_dir, data_file), f"run.dir={run}"])
    assert done.returncode == 0, done.stderr
    return run


# SIGINT's is slow: one handler serves both (its exit 130 stays in the default suite through
# the start-up test and the in-process StopSignals cases below).
@pytest.mark.parametrize(
    ("sig", "code"), [("TERM", 143), pytest.param("INT", 130, marks=pytest.mark.slow)]
)
def test_a_signal_mid_step_saves_the_last_applied_step_and_resumes_bit_exact(
    sig: str, code: int, tiny_llama_dir: Path, data_file: Path, straight: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = [*common(tiny_llama_dir, data_file), f"run.dir={run}"]
    # 10 packed rows in steps of 4: the third step of each epoch holds the 2 rows left, one
    # micro-batch, so steps 1-4 hold micro-batches 0-6 and 7 is the first of step 5's two:
    # step 5 is abandoned half-way.
    stopped = leantune(args, {SIGNAL_ENV: f"7:{sig}"})
    assert stopped.returncode == code, stopped.stderr
    assert "Traceback" not in stopped.stderr + stopped.stdout
    ckpt = run / "checkpoints" / "step-000004"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004"]
    (line,) = [x for x in stopped.stderr.splitlines() if f"SIG{sig}" in x]
    assert str(ckpt) in line and "same command" in line
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["micro_batches_seen"] == 7
    assert state["extra"]["batching"]["samples_seen"] == 14  # 4 + 4 + 2, then 4
    assert not (run / "final").exists()
    resumed = leantune(args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step 4" in resumed.stdout
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    for key in ("step", "loss", "lr", "grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    wa = load_file(straight / "final" / "adapter_model.safetensors")
    wb = load_file(run / "final" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_signal_during_start_up_exits_130_with_one_line_and_no_run_dir(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "fresh" / "run"
    stopped = leantune([*common(tiny_llama_dir, data_file), f"run.dir={run}"], {START_ENV: "INT"})
    assert stopped.returncode == 130, stopped.stderr
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr
    (line,) = [x for x in stopped.stderr.splitlines() if "SIGINT" in x]
    assert "no checkpoint was written" in line and "starts over" in line
    assert not (tmp_path / "fresh").exists()


def _on_a_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is its stdin (the pty),
    with SIGHUP's default action, as a login shell's job has."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_a_dropped_terminal_saves_a_checkpoint_and_exits_129(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path
) -> None:
    """The ssh session drops: train's terminal is hung up (its pty's other end closed), the
    kernel sends SIGHUP, and every later write to the terminal fails. The run stops at the
    next micro-batch boundary with a checkpoint, says so in events.jsonl and exits 129."""
    run = tmp_path / "run"
    args = [*common(tiny_llama_dir, data_file), f"run.dir={run}"]
    # Long enough never to finish first; the progress bar writes to the terminal as it goes.
    args += ["train.max_steps=5000", "train.save_every=2", "run.progress=true"]
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in (SIGNAL_ENV, START_ENV)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "leantune", "train", *args],
        env={**env, "PYTHONPATH": str(SRC)},
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=_on_a_terminal,
    )
    os.close(slave)
    seen: list[bytes] = []
    try:
        deadline = time.monotonic() + 120
        while not any((run / "checkpoints").glob("step-*")):  # training is under way
            assert proc.poll() is None and time.monotonic() < deadline, b"".join(seen)
            _drain(master, seen)
    finally:
        # The terminal hangs up when its last reference closes: no read may be pending.
        os.close(master)
    code = proc.wait(timeout=120)
    assert code == 129, b"".join(seen).decode(errors="replace")[-3000:]
    assert not (run / "final").exists()
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
    assert 2 <= step < 5000
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    (stop,) = [e for e in events if e["kind"] == "signal"]
    assert stop["message"].startswith(f"SIGHUP: stopped before step {step + 1}; checkpoint")
    assert stop["checkpoint"] == str(ckpt)


def _drain(fd: int, into: list[bytes]) -> None:
    """Read what the terminal has (waiting 50 ms at most): a full pty would block the writer."""
    if select.select([fd], [], [], 0.05)[0]:
        with contextlib.suppress(OSError):  # EIO: the child has closed its side
            into.append(os.read(fd, 4096))


def test_the_first_signal_is_deferred_and_a_second_one_stops_at_once() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested == signal.SIGTERM  # only noted
            with pytest.raises(Interrupted) as first:
                stop.check()  # at the next micro-batch boundary
            assert first.value.at_boundary and first.value.exit_code == 143
            # While that stop saves its checkpoint, another signal ends it at once.
            with pytest.raises(Interrupted) as second:
                os.kill(os.getpid(), signal.SIGINT)
            assert not second.value.at_boundary and second.value.exit_code == 130
        with pytest.raises(Interrupted):  # outside the loop: at once
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_sighup_stops_like_sigterm_with_129_and_nohup_keeps_it_ignored() -> None:
    before = signal.getsignal(signal.SIGHUP)
    try:
        # A suite started under nohup inherits SIGHUP ignored, which StopSignals keeps (the
        # second half): the first half is about a terminal's SIGHUP, so it starts from the default.
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with StopSignals() as stop, stop.deferred():
            # Checked first: with SIGHUP's default action the kill below would end pytest.
            assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)
            os.kill(os.getpid(), signal.SIGHUP)
            with pytest.raises(Interrupted) as hup:
                stop.check()
        assert hup.value.at_boundary and hup.value.exit_code == 129
        assert str(hup.value) == "SIGHUP: stopped"
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup leantune train` starts
        with StopSignals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_train_restores_the_previous_handlers(
    tiny_llama_dir: Path, data_file: Path, tmp_path: Path
) -> None:
    handlers = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = [signal.getsignal(s) for s in handlers]
    result = run_cli(["train", *common(tiny_llama_dir, data_file), f"run.dir={tmp_path / 'r'}"])
    assert result.code == 0, result.err
    assert [signal.getsignal(s) for s in handlers] == before


def test_ctrl_c_in_any_command_is_one_line_and_130(monkeypatch, capsys) -> None:
    from leantune.cli import app as cli

    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr("leantune.cli.commands.train.cmd_validate", interrupted)
    assert cli.main(["validate"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted (SIGINT)"
