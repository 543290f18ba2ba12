"""oneDNN's kernel caches, bounded: without it a run's RSS grows with every new row length.

torch runs bf16 matmuls, bmm and the flash attention's kernels on CPU through oneDNN, which
compiles a kernel for each shape and keeps it in two caches keyed by the shape: oneDNN's
primitive cache and ideep's LRU cache of its matmul objects, 1024 entries each by default.
Packed rows, micro-batches and their examples change length at every step, so every step adds
entries: on a 2-core EPYC (avx512_bf16, no AMX), the demo model's linears in bf16 grew RSS by
~6 MB per new length (~0.5 MiB per shape cached, the two caches about half each, whatever the
shape's size), up to ~0.6 GiB at ~100 lengths where the caches fill; a LoRA DPO run grew from
1.90 to 2.38 GiB in 16 steps. fp32 matmuls (MKL) cache nothing. With both caches at
`CAPACITY` entries, which still hold the kernels one micro-batch reuses across the layers and
from forward to backward, the same run stayed at 2.17-2.20 GiB at the same step time
(docs/benchmarks.md#kernel-caches). Both libraries read the capacities once, at their first
bf16 matmul, so they are set in the environment before then: by the `leantune` command before
torch loads (`cli.app.run`), and by the training set-up before its precision probe (the Python
API; a process that ran a bf16 matmul before keeps its caches as they are). A capacity the
user set is theirs. Torch-free: the CLI imports it before torch.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from leantune.errors import UserError

CAPACITY = 128
"""Entries per cache: both caches full hold ~67 MiB (tests/unit/core/test_kernel_caches.py),
against ~0.55 GiB at oneDNN's 1024."""
PRIMITIVES = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
LRU = "LRU_CACHE_CAPACITY"
ALIASES = {PRIMITIVES: ("DNNL_PRIMITIVE_CACHE_CAPACITY",)}
"""oneDNN also reads its variable's older DNNL_ name: one set so is the user's choice too."""
MARK = "LEANTUNE_KERNEL_CACHES"
"""The variables leantune set (not the user), comma-separated: a benchmark's baseline runs
without them (`without_leantune_kernel_caches`)."""


def bound_kernel_caches(environ: MutableMapping[str, str]) -> list[str]:
    """Set both caches' capacities to `CAPACITY` in `environ` (os.environ: before the first
    bf16 matmul) where the user set neither that variable nor its alias; the names set.

    Raises:
        UserError: LRU_CACHE_CAPACITY=0, which crashes torch (a segmentation fault in ideep).
    """
    if environ.get(LRU, "").strip() == "0":
        raise UserError(
            f"{LRU}=0 crashes torch at its first bf16 matmul (ideep needs at least 1 entry); "
            f"set {LRU}=1 or more, or unset it for leantune's {CAPACITY}"
        )
    ours = [n for n in environ.get(MARK, "").split(",") if n]
    for name in (PRIMITIVES, LRU):
        if name in ours or any(environ.get(n, "").strip() for n in (name, *ALIASES.get(name, ()))):
            continue
        environ[name] = str(CAPACITY)
        ours.append(name)
    if ours:
        environ[MARK] = ",".join(ours)
    return ours


def without_leantune_kernel_caches(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the capacities leantune set (the user's own stay)."""
    env = dict(environ)
    for name in env.pop(MARK, "").split(","):
        env.pop(name, None)
    return env
