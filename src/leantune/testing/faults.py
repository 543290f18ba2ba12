"""Test fault hooks, read from the environment once per run; all off unless set.

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
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

import torch
from torch import nn

KILL_ENV = "LEANTUNE_KILL_AFTER_MICRO_BATCH"
OOM_STEP_ENV = "LEANTUNE_OOM_AT_STEP"
OOM_EVAL_ENV = "LEANTUNE_OOM_IN_EVAL"
LOSS_SCALE_ENV = "LEANTUNE_LOSS_SCALE_AT_STEP"
SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_MICRO_BATCH"
START_SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_START"
FAULT_RANK_ENV = "LEANTUNE_FAULT_RANK"


def _this_rank_is_hit(first_attempt_only: bool) -> bool:
    """Whether a fault meant for LEANTUNE_FAULT_RANK (all ranks when unset) hits this one."""
    rank = os.environ.get(FAULT_RANK_ENV)
    if rank is None:
        return True
    if first_attempt_only and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    return os.environ.get("RANK", "0") == rank


def kill_after(micro_batch: int) -> None:
    """SIGKILL this process if ``LEANTUNE_KILL_AFTER_MICRO_BATCH`` names this micro-batch."""
    target = os.environ.get(KILL_ENV)
    if target is not None and int(target) == micro_batch and _this_rank_is_hit(True):
        os.kill(os.getpid(), signal.SIGKILL)


def signal_after(micro_batch: int) -> None:
    """Signal this process if ``LEANTUNE_SIGNAL_AT_MICRO_BATCH`` names this micro-batch."""
    spec = os.environ.get(SIGNAL_ENV)
    if spec:
        target, name = spec.split(":")
        if int(target) == micro_batch:
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))


def signal_at_start() -> None:
    """Signal this process if ``LEANTUNE_SIGNAL_AT_START`` is set."""
    name = os.environ.get(START_SIGNAL_ENV)
    if name:
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))


class FaultHooks:
    """The OOM and loss-spike hooks of one run (each fires at most once)."""

    def __init__(self) -> None:
        oom_step = os.environ.get(OOM_STEP_ENV)
        self.oom_step = int(oom_step) if oom_step and _this_rank_is_hit(False) else None
        self.eval_ooms = int(os.environ.get(OOM_EVAL_ENV) or 0)
        scale = os.environ.get(LOSS_SCALE_ENV)
        self.scale_step: int | None = None
        self.scale = 1.0
        if scale and _this_rank_is_hit(False):
            step, factor = scale.split(":")
            self.scale_step, self.scale = int(step), float(factor)

    def train_oom(self, step: int, micro_batch: int, count: int) -> None:
        """Raise the simulated OOM in the last micro-batch of the configured step, once."""
        if self.oom_step == step and micro_batch == count - 1:
            self.oom_step = None
            raise torch.OutOfMemoryError(f"simulated out of memory ({OOM_STEP_ENV}={step})")

    def eval_oom(self) -> None:
        """Raise the simulated OOM for the next evaluation attempt while any are left."""
        if self.eval_ooms > 0:
            self.eval_ooms -= 1
            raise torch.OutOfMemoryError(f"simulated out of memory in evaluation ({OOM_EVAL_ENV})")

    def spike(self, step: int, loss: float, params: Iterable[nn.Parameter]) -> float:
        """Scale the loss and gradients of the configured step (as if the loss were scaled)."""
        if self.scale_step != step:
            return loss
        self.scale_step = None
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.scale)
        return loss * self.scale
