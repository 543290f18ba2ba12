"""oneDNN's kernel caches bounded: both capacities set before the first bf16 matmul unless the
user set them, carried by the re-executed command, taken out for a benchmark's baseline, and
bounding what a process keeps for the row lengths it has seen."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import reexecuted_environment

from leantune.bench.throughput import baseline_environment
from leantune.core.kernel_caches import (
    CAPACITY,
    LRU,
    MARK,
    PRIMITIVES,
    bound_kernel_caches,
    without_leantune_kernel_caches,
)
from leantune.errors import UserError

VARIABLES = (PRIMITIVES, LRU, MARK, "DNNL_PRIMITIVE_CACHE_CAPACITY")


def test_both_caches_are_bounded_unless_the_user_set_them() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert bound_kernel_caches(env) == [PRIMITIVES, LRU]
    assert env == {
        "PATH": "/bin",
        PRIMITIVES: str(CAPACITY),
        LRU: str(CAPACITY),
        MARK: f"{PRIMITIVES},{LRU}",
    }
    # The re-executed process finds the same and keeps it.
    assert bound_kernel_caches(env) == [PRIMITIVES, LRU] and env[LRU] == str(CAPACITY)
    assert without_leantune_kernel_caches(env) == {"PATH": "/bin"}
    # The user's values (oneDNN's older DNNL_ name included) are theirs, and stay in a baseline.
    env = {LRU: "4096", "DNNL_PRIMITIVE_CACHE_CAPACITY": "2048"}
    assert bound_kernel_caches(env) == [] and MARK not in env and env[LRU] == "4096"
    assert PRIMITIVES not in env
    env = {PRIMITIVES: "0"}
    assert bound_kernel_caches(env) == [LRU] and env[PRIMITIVES] == "0"
    assert without_leantune_kernel_caches(env) == {PRIMITIVES: "0"}
    assert baseline_environment({**env, MARK: LRU, LRU: "128"}) == {PRIMITIVES: "0"}


def test_a_capacity_that_crashes_torch_is_refused_naming_the_fix() -> None:
    with pytest.raises(
        UserError, match=r"LRU_CACHE_CAPACITY=0 crashes torch.*set LRU_CACHE_CAPACITY=1"
    ):
        bound_kernel_caches({LRU: "0"})


def test_the_reexecuted_command_carries_the_capacities(monkeypatch) -> None:
    seen = reexecuted_environment(monkeypatch, VARIABLES, contended=False)
    assert seen[PRIMITIVES] == seen[LRU] == str(CAPACITY)


# A fresh process (the capacities are read at its first bf16 matmul), torch imported first as
# the Python API's caller would have: bf16 linears forward and backward over 48 row lengths,
# the growth of RSS (glibc, trimmed) printed in MiB.
_GROWTH = """
import ctypes, os, sys, torch
from leantune.core.kernel_caches import bound_kernel_caches
if sys.argv[1] == "bounded":
    bound_kernel_caches(os.environ)
torch.set_num_threads(1)
trim = ctypes.CDLL("libc.so.6").malloc_trim
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
w = [torch.randn(n, 64, requires_grad=True) for n in (64, 96, 128)]
def step(n):
    x = torch.randn(n, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sum(torch.nn.functional.linear(x, v).float().sum() for v in w)
    y.backward()
step(8); trim(0); start = rss()
for n in range(9, 57):
    step(n)
trim(0); print(rss() - start)
"""


def _growth(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", _GROWTH, mode], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


def test_the_bound_caps_what_new_row_lengths_keep_alive() -> None:
    # 48 lengths x 3 shapes x 3 kernels (forward, grad of input, grad of weight) = 432 entries:
    # measured 236 MiB at oneDNN's defaults (1024 entries), 67 MiB bounded (128), 0.1 MiB
    # with no caching; the same to 0.1 MiB from run to run.
    unbounded, bounded = _growth("default"), _growth("bounded")
    assert unbounded > 150, unbounded
    assert bounded < 0.45 * unbounded, (bounded, unbounded)
