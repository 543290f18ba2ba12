"""`leantune train --nproc N`: the same command under torchrun, on this machine.

It replaces this process with ``python -m torch.distributed.run --standalone
--nproc-per-node N [--max-restarts R] -m leantune train ...`` (a free rendezvous port on
localhost) and tells every rank the world size it asked for, which the rank checks when it joins
the process group. Several machines need torchrun itself (README: "Several processes").
"""

from __future__ import annotations

import os
import sys

from leantune.errors import UserError

# Checked when a rank joins: a launcher that silently starts fewer processes fails at once
# instead of training on one.
EXPECTED_WORLD_ENV = "LEANTUNE_EXPECTED_WORLD_SIZE"
"""Set by `leantune train --nproc N`: the world size torchrun must have started."""
NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def torchrun_command(nproc: int, max_restarts: int, train_args: list[str]) -> list[str]:
    """The torchrun command line that runs `leantune <train_args>` on `nproc` processes."""
    return [
        sys.executable,  # the same interpreter (and venv) as this leantune
        "-m",
        "torch.distributed.run",
        "--standalone",  # a local rendezvous on a free port: no address or port to configure
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "leantune",
        *train_args,
    ]


def exec_torchrun(nproc: int, max_restarts: int, train_args: list[str]) -> None:
    """Replace this process with torchrun (never returns).

    Raises:
        UserError: this process is already one of torchrun's.
    """
    if launched_by_torchrun():
        raise UserError("--nproc inside a torchrun process: leave it out, torchrun started it")
    command = torchrun_command(nproc, max_restarts, train_args)
    env = dict(os.environ, **{EXPECTED_WORLD_ENV: str(nproc)})
    # A restart reusing the rendezvous store can read the killed attempt's addresses and fail
    # to connect (pytorch#135712): give each attempt a store of its own.
    env.setdefault(NO_SHARED_STORE_ENV, "1")
    # torchrun gives each of several processes 1 thread; the cores are the ranks' to share.
    env.setdefault("OMP_NUM_THREADS", str(rank_threads(nproc)))
    # execve discards Python's buffers: what was printed before would be lost.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


def rank_threads(nproc: int) -> int:
    """Intra-op threads per rank: this machine's usable physical cores shared out evenly."""
    # core.threads imports torch; `leantune train --nproc N` execs torchrun before it loads.
    from leantune.core.threads import usable_physical_cores

    return max(1, usable_physical_cores() // nproc)


def rank_tag() -> str:
    """``rank R of W: `` in a process of a multi-process run (torchrun's env), else ``""``."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"rank {os.environ.get('RANK', '?')} of {world}: " if world > 1 else ""


def launched_by_torchrun() -> bool:
    """Whether torchrun (or another env:// launcher) started this process."""
    # All four: the env:// rendezvous needs each, and a stray RANK alone is no launcher.
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def launched_world_size() -> int:
    """The processes this run is one of: torchrun's WORLD_SIZE, else 1."""
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
