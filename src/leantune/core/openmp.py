"""The OpenMP wait policy of torch's CPU threads, chosen before torch loads: passive.

torch's pip wheels run their intra-op threads on GNU OpenMP (libgomp). By default a libgomp
thread that reaches the barrier at the end of an operator spins for a while (GOMP_SPINCOUNT,
300,000 iterations) before it sleeps. On an idle machine that saves a wake-up per operator;
beside another busy process it is a stall: the spinning thread holds a core that the thread it
waits for needs, and a step runs thousands of operators, each ending in such a barrier. Measured
on a 2-core EPYC beside one busy core: a linear+LoRA forward/backward loop in 2 threads ran
several times slower spinning than passive (docs/guides/cpu.md#threads-under-load).

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when the library is loaded (at
`import torch`), so they cannot be changed by a process that has imported torch. The `leantune`
command sets the policy in its own environment before any command imports torch
(`cli.app.run`); the re-execution that preloads tcmalloc (`core.allocator`) inherits it. A
policy the user set (either variable) is theirs: OMP_WAIT_POLICY=ACTIVE restores spinning.
Torch-free: the CLI imports it before torch.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

POLICY = "OMP_WAIT_POLICY"
SPINCOUNT = "GOMP_SPINCOUNT"
PASSIVE = "PASSIVE"
MARK = "LEANTUNE_WAIT_POLICY"
"""Set when leantune chose the policy (not the user): children that must run as their user
would (the benchmarks' baselines) take it out again (`without_leantune_wait_policy`)."""


def set_wait_policy(environ: MutableMapping[str, str]) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE in `environ` (os.environ: before torch is imported) unless
    the user chose a policy; whether leantune set it."""
    if environ.get(POLICY) or environ.get(SPINCOUNT):
        return environ.get(MARK) == PASSIVE  # ours from the process that re-executed this one
    environ[POLICY] = PASSIVE
    environ[MARK] = PASSIVE
    return True


def waits_passive(environ: Mapping[str, str]) -> bool:
    """Whether this process's OpenMP threads sleep at a barrier (OMP_WAIT_POLICY=PASSIVE, set
    before torch loaded: leantune's command sets it, a user may)."""
    return environ.get(POLICY, "").upper() == PASSIVE


def wait_policy_note(environ: Mapping[str, str]) -> str:
    """How this process's OpenMP threads wait at a barrier, for the log."""
    if environ.get(MARK) and environ.get(POLICY) == PASSIVE:
        return "waits passive (set by leantune; OMP_WAIT_POLICY=ACTIVE spins)"
    if environ.get(POLICY) or environ.get(SPINCOUNT):
        mine = ", ".join(f"{k}={environ[k]}" for k in (POLICY, SPINCOUNT) if environ.get(k))
        return f"waits as you set ({mine})"
    # The Python API in a process that did not set it before importing torch.
    return "waits spinning (libgomp's default; OMP_WAIT_POLICY=PASSIVE before torch loads)"


def without_leantune_wait_policy(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the wait policy leantune set (a user's own stays)."""
    env = dict(environ)
    if env.pop(MARK, None) is not None and env.get(POLICY) == PASSIVE:
        env.pop(POLICY)
    return env
