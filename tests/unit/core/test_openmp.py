"""The OpenMP wait policy: passive when the start finds the machine busy, libgomp's own when idle,
unless the user chose one; set before torch loads, carried by the re-execution that preloads
tcmalloc, never given to a benchmark's baseline."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from support import reexecuted_environment

from leantune.bench.throughput import baseline_environment
from leantune.cli import app
from leantune.core import allocator
from leantune.core.openmp import (
    MARK,
    POLICY,
    SPINCOUNT,
    set_wait_policy,
    wait_policy_note,
    without_leantune_wait_policy,
)


def test_passive_when_the_start_finds_the_machine_busy_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert set_wait_policy(env, lambda: True) and env == {POLICY: "PASSIVE", MARK: "PASSIVE"}
    assert wait_policy_note(env).startswith("waits passive (set by leantune")
    # The re-executed process keeps the decision without measuring again.
    assert set_wait_policy(env, _not_measured) and env[POLICY] == "PASSIVE"
    # Idle: libgomp's spinning, measured faster there; marked, so the child does not re-measure.
    env = {}
    assert not set_wait_policy(env, lambda: False) and env == {MARK: "SPIN"}
    assert wait_policy_note(env).startswith("waits spinning (libgomp's default: the machine was")
    assert not set_wait_policy(env, _not_measured) and POLICY not in env
    for name, value in ((POLICY, "ACTIVE"), (SPINCOUNT, "10000")):
        env = {name: value}
        assert not set_wait_policy(env, _not_measured) and env == {name: value}
        assert wait_policy_note(env) == f"waits as you set ({name}={value})"


def _not_measured() -> bool:
    raise AssertionError("the load is measured once, where nothing decided the policy yet")


def test_the_baseline_runs_with_the_policy_its_user_has() -> None:
    ours = {POLICY: "PASSIVE", MARK: "PASSIVE", "PATH": "/bin"}
    assert without_leantune_wait_policy(ours) == {"PATH": "/bin"}
    assert without_leantune_wait_policy({POLICY: "PASSIVE"}) == {POLICY: "PASSIVE"}
    preloaded = allocator.preloaded_environment(ours, Path("/lib/libtcmalloc.so.4"))
    base = baseline_environment(preloaded)
    assert base["PATH"] == "/bin" and not {POLICY, MARK, "LD_PRELOAD"} & set(base)


def test_the_reexecuted_command_carries_the_wait_policy(monkeypatch) -> None:
    seen = reexecuted_environment(monkeypatch, (POLICY, SPINCOUNT, MARK), contended=True)
    assert seen[POLICY] == "PASSIVE" and seen[MARK] == "PASSIVE"
    assert seen["LD_PRELOAD"] == "/lib/libtcmalloc.so.4"
    assert os.environ[POLICY] == "PASSIVE"  # this process too, where the exec fails


def test_a_caller_of_main_keeps_its_own_environment(monkeypatch) -> None:
    monkeypatch.delenv(POLICY, raising=False)
    args = argparse.Namespace(own_process=False, command="train", check=None, run="x:y")
    monkeypatch.setattr(app, "command_function", lambda target: lambda a: 0)
    assert app.run(args) == 0 and POLICY not in os.environ
