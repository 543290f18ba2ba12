"""The OpenMP wait policy of torch's CPU threads, chosen before torch loads from the load found.

torch's pip wheels run their intra-op threads on GNU OpenMP (libgomp). By default a libgomp
thread that reaches the barrier at the end of an operator spins for a while (GOMP_SPINCOUNT)
before it sleeps. On an idle machine that saves a wake-up per operator: measured on leantune's
own LoRA step on a 2-core EPYC, idle, spinning took 1.15-1.47 s a step against 1.53-1.60 s
passive. Beside another busy process it is a stall: the spinning thread holds a core that the
thread it waits for needs, at every operator; a linear+LoRA loop in 2 threads ran 3.4-6x slower
spinning than passive there (docs/guides/cpu.md#threads-under-load). So the `leantune` command
measures the load for a quarter second at its start: contended, passive; idle, libgomp's own.

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when the library is loaded (at
`import torch`), so they cannot be changed by a process that has imported torch. The `leantune`
command decides in its own environment before any command imports torch (`cli.app.run`); the
re-execution that preloads tcmalloc (`core.allocator`) inherits the decision. A policy the user
set (either variable) is theirs. Torch-free: the CLI imports it before torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping

POLICY = "OMP_WAIT_POLICY"
SPINCOUNT = "GOMP_SPINCOUNT"
PASSIVE = "PASSIVE"
SPIN = "SPIN"
MARK = "LEANTUNE_WAIT_POLICY"
"""Set when leantune chose the policy (not the user): children that must run as their user
would (the benchmarks' baselines) take it out again (`without_leantune_wait_policy`)."""


def set_wait_policy(environ: MutableMapping[str, str], contended: Callable[[], bool]) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE in `environ` (os.environ: before torch is imported) when
    `contended()` (measured once: the decision is marked for the re-executed process), unless
    the user chose a policy; whether leantune set it."""
    if environ.get(MARK):  # decided by the process that re-executed this one
        return environ[MARK] == PASSIVE
    if environ.get(POLICY) or environ.get(SPINCOUNT):
        return False
    if contended():
        environ[POLICY] = PASSIVE
        environ[MARK] = PASSIVE
        return True
    environ[MARK] = SPIN
    return False


def waits_passive(environ: Mapping[str, str]) -> bool:
    """Whether this process's OpenMP threads sleep at a barrier (OMP_WAIT_POLICY=PASSIVE, set
    before torch loaded: leantune's command sets it, a user may)."""
    return environ.get(POLICY, "").upper() == PASSIVE


def wait_policy_note(environ: Mapping[str, str]) -> str:
    """How this process's OpenMP threads wait at a barrier, for the log."""
    if environ.get(MARK) and environ.get(POLICY) == PASSIVE:
        return "waits passive (set by leantune: the machine was busy at the start)"
    if environ.get(MARK) == SPIN and not environ.get(POLICY):
        return "waits spinning (libgomp's default: the machine was idle at the start)"
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
