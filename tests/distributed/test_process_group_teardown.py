"""A torchrun rank ends cleanly: its run ends the process group it created, and the rank leaves
without the interpreter's teardown.

FSDP2's DTensor caches and DeepSpeed's globals keep the gloo process group object alive to the
end of the process, and `destroy_process_group` does not stop its threads while anything holds
it. A finished rank that tore its interpreter down under those threads aborted intermittently
("terminate called without an active exception", SIGABRT, about one 2-process FSDP2/ZeRO-3 job
in forty here), failing a run that had written everything.
"""

from __future__ import annotations

import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from support import _env, make_config

from leantune.training import recipe
from leantune.training.parallel import world


def _watched_groups(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref[Any]]:
    """Weak references to the process group each run creates."""
    groups: list[weakref.ref[Any]] = []
    joined = world.init_world

    def init_and_watch(*args: Any, **kwargs: Any) -> world.World:
        found = joined(*args, **kwargs)
        groups.append(weakref.ref(dist.group.WORLD))
        return found

    monkeypatch.setattr(world, "init_world", init_and_watch)
    return groups


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_run_ends_the_process_group_it_created(
    tiny_llama_dir: Path,
    dist_train_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
) -> None:
    groups = _watched_groups(monkeypatch)
    overrides = (f"dist.strategy={strategy}", "train.precision=fp32", "train.max_steps=2")
    cfg = make_config(tiny_llama_dir, dist_train_file, tmp_path / "run", *overrides)
    recipe.train(cfg, log=lambda _: None)
    assert len(groups) == 1 and not dist.is_initialized()
    if strategy == "ddp":  # nothing of torch's keeps it: freed with the run, not at exit
        assert groups[0]() is None, "the process group outlived the run"


# Imported by the rank (PYTHONPATH): an object whose finaliser speaks only if the interpreter
# is torn down, which a rank must not do.
_SITECUSTOMIZE = """
import atexit, sys
class _Teardown:
    def __del__(self):
        sys.stderr.write("INTERPRETER TEARDOWN\\n")
_marker = _Teardown()
atexit.register(lambda: sys.stderr.write("EXIT HANDLERS RAN\\n"))
"""


@pytest.mark.parametrize(
    ("launched", "args", "code"),
    [
        (True, ["validate"], 0),
        (True, ["validate", "no-such-config.yaml"], 2),
        (False, ["validate", "no-such-config.yaml"], 2),
    ],
)
def test_a_torchrun_rank_leaves_after_its_exit_handlers_without_the_teardown(
    tmp_path: Path, launched: bool, args: list[str], code: int
) -> None:
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    rank = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    env = _env(
        PYTHONPATH=f"{tmp_path}:{_env().get('PYTHONPATH', '')}", **(rank if launched else {})
    )
    done = subprocess.run(
        [sys.executable, "-m", "leantune", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr[-2000:]
    assert "EXIT HANDLERS RAN" in done.stderr
    assert ("INTERPRETER TEARDOWN" in done.stderr) is not launched
