"""Test fault hooks from the environment: the `StepHooks` the CLI installs; all off unless set.

- ``LEANTUNE_KILL_AFTER_MICRO_BATCH=k``: SIGKILL right after the backward of global micro-batch k.
- ``LEANTUNE_OOM_AT_STEP=k``: a simulated ``torch.OutOfMemoryError`` in the last micro-batch of
  step k (first attempt only, so the replay with a smaller micro-batch succeeds).
- ``LEANTUNE_OOM_IN_EVAL=n``: the first n evaluation attempts run out of memory.
- ``LEANTUNE_LOSS_SCALE_AT_STEP=k:f``: multiply step k's loss and gradients by f (a spike).
- ``LEANTUNE_SIGNAL_AT_MICRO_BATCH=k:SIG``: send SIGSIG (TERM or INT) to this process right after
  the backward of global micro-batch k: a real signal at a known point of the loop.
- ``LEANTUNE_SIGNAL_AT_START=SIG``: send SIGSIG to this process as `train` starts setting up.
- ``LEANTUNE_FAULT_RANK=r``: under torchrun, the kill, the OOM and the loss scale hit rank r
  only, and the kill only torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0), so a restart
  gets on.

The variables are read once per run, when the run's hooks are made (`EnvFaults()`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from typing import TYPE_CHECKING

from leantune.training.hooks import install_step_hooks

if TYPE_CHECKING:
    from torch import nn

KILL_ENV = "LEANTUNE_KILL_AFTER_MICRO_BATCH"
OOM_STEP_ENV = "LEANTUNE_OOM_AT_STEP"
OOM_EVAL_ENV = "LEANTUNE_OOM_IN_EVAL"
LOSS_SCALE_ENV = "LEANTUNE_LOSS_SCALE_AT_STEP"
SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_MICRO_BATCH"
START_SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_START"
FAULT_RANK_ENV = "LEANTUNE_FAULT_RANK"


def install_env_faults() -> None:
    """Give every later run the faults its environment names (the CLI's entry calls this)."""
    install_step_hooks(EnvFaults)


def _this_rank_is_hit(first_attempt_only: bool) -> bool:
    """Whether a fault meant for LEANTUNE_FAULT_RANK (all ranks when unset) hits this one."""
    rank = os.environ.get(FAULT_RANK_ENV)
    if rank is None:
        return True
    # A restarted attempt runs without the fault, so that the restart gets on.
    if first_attempt_only and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    return os.environ.get("RANK", "0") == rank


def _micro_batch_signal() -> tuple[int, signal.Signals] | None:
    spec = os.environ.get(SIGNAL_ENV)
    if not spec:
        return None
    target, name = spec.split(":")
    return int(target), getattr(signal, f"SIG{name}")


class EnvFaults:
    """The faults of one run, from the environment (the OOMs and the spike fire at most once)."""

    def __init__(self) -> None:
        kill = os.environ.get(KILL_ENV)
        # Only the kill spares torchrun's restarts: it would kill every restart again.
        self.kill_at = int(kill) if kill is not None and _this_rank_is_hit(True) else None
        self.signal_at = _micro_batch_signal()
        start = os.environ.get(START_SIGNAL_ENV)
        self.start_signal = getattr(signal, f"SIG{start}") if start else None
        oom_step = os.environ.get(OOM_STEP_ENV)
        self.oom_step = int(oom_step) if oom_step and _this_rank_is_hit(False) else None
        self.eval_ooms = int(os.environ.get(OOM_EVAL_ENV) or 0)
        scale = os.environ.get(LOSS_SCALE_ENV)
        self.scale_step: int | None = None
        self.scale = 1.0
        if scale and _this_rank_is_hit(False):
            step, factor = scale.split(":")
            self.scale_step, self.scale = int(step), float(factor)

    def at_start(self) -> None:
        """LEANTUNE_SIGNAL_AT_START: the signal, as `train` starts setting up."""
        if self.start_signal is not None:
            os.kill(os.getpid(), self.start_signal)

    def check_memory(self, step: int, micro_batch: int, count: int) -> None:
        """LEANTUNE_OOM_AT_STEP: the simulated OOM in the step's last micro-batch, once."""
        if self.oom_step == step and micro_batch == count - 1:
            self.oom_step = None  # once: the replay with a smaller micro-batch must succeed
            raise _out_of_memory(f"simulated out of memory ({OOM_STEP_ENV}={step})")

    def after_backward(self, micro_batch: int) -> None:
        """LEANTUNE_KILL_AFTER_MICRO_BATCH, then LEANTUNE_SIGNAL_AT_MICRO_BATCH."""
        if self.kill_at == micro_batch:
            # SIGKILL: no handler runs and nothing is saved, as when the machine dies.
            os.kill(os.getpid(), signal.SIGKILL)
        if self.signal_at is not None and self.signal_at[0] == micro_batch:
            os.kill(os.getpid(), self.signal_at[1])

    def window_loss(self, step: int, loss: float, params: Iterable[nn.Parameter]) -> float:
        """LEANTUNE_LOSS_SCALE_AT_STEP: the step's loss and gradients scaled (as if the loss
        were), once."""
        if self.scale_step != step:
            return loss
        self.scale_step = None
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(self.scale)  # detached: in place, outside autograd
        # The loss too: the guard watches the loss and the gradient norm, and a real spike
        # moves both.
        return loss * self.scale

    def before_eval(self) -> None:
        """LEANTUNE_OOM_IN_EVAL: the simulated OOM while any of the n attempts are left."""
        if self.eval_ooms > 0:
            self.eval_ooms -= 1
            raise _out_of_memory(f"simulated out of memory in evaluation ({OOM_EVAL_ENV})")


def _out_of_memory(message: str) -> BaseException:
    # Deferred: the CLI imports this module before it knows whether the command needs torch
    # (`leantune --help` stays torch-free); a fault fires only inside a run, torch loaded.
    import torch

    return torch.OutOfMemoryError(message)
