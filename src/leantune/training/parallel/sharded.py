"""Sharded checkpoints (fsdp2): torch.distributed.checkpoint with leantune's commit marker.

Every rank writes its shard of the trainable weights and of the optimizer state into
``.tmp-step-N-sharded/dcp/`` (`dcp.save`); rank 0 then writes the trainer state, the
``COMPLETE`` marker listing every file with its size and SHA-256, and renames the folder to
``step-N`` with the same atomic install as a single-process save
(:mod:`leantune.training.state.checkpoint`). Rank 0 finds and verifies the checkpoint to resume;
every rank then reads its share with `dcp.load` into the shapes of the current world.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from leantune.layout import checkpoint_name
from leantune.training.guard.divergence import diverged
from leantune.training.parallel import collectives as c
from leantune.training.parallel.parts import CheckpointParts, Warn
from leantune.training.parallel.world import World
from leantune.training.state import checkpoint as ck
from leantune.training.state import verify
from leantune.training.state.checkpoint import Checkpoint, CheckpointError
from leantune.training.state.files import clear, fsync_dir, write_text_durable
from leantune.training.state.format import TMP_PREFIX
from leantune.training.state.reading import newest_complete

_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def _trainable_state(model: nn.Module) -> dict[str, Any]:
    """The model's trainable parameters by name, this rank's shards of them."""
    # Filtered again: `ignore_frozen_params` still leaves the quantisation state a 4-bit layer
    # adds to its state dict for the whole frozen weight every rank keeps, which is not the
    # run's to save.
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = get_model_state_dict(model, options=_TRAINABLE)
    return {k: v for k, v in state.items() if k in trainable}


def save(world: World, root: Path, model: nn.Module, parts: CheckpointParts) -> Path:
    """Write ``root/step-N`` from every rank's shards; returns it on every rank.

    Raises:
        WeightsDiverged: a trainable weight holds NaN or inf on some rank (on every rank).
        CheckpointError: rank 0 could not write or commit it (on every rank).
    """
    step = parts.state.step
    # Each rank checks only its own shards; the collective makes every rank refuse alike.
    local = [_local(p) for p in parts.params.values()]
    if c.nonfinite_anywhere(world, local):
        # Empty on a rank whose shards are fine: its message still needs a name.
        bad = [n for n, t in zip(parts.params, local, strict=True) if not t.isfinite().all()]
        raise diverged(step, bad or ["(a shard on another rank)"], newest_complete(root))
    name = checkpoint_name(step)
    # No pid in the name, unlike a single-process save: every rank must agree on the folder.
    tmp = root / f"{TMP_PREFIX}{name}-sharded"
    # Rank 0 makes the folder; _on_main's broadcast holds the others until it exists.
    _on_main(world, lambda: _fresh_dir(root, tmp), "prepare the checkpoint folder")
    state: dict[str, Any] = {"model": _trainable_state(model)}
    if parts.optimizer.state:  # a fresh optimizer has none (and DCP would make one up)
        state["optim"] = get_optimizer_state_dict(model, parts.optimizer)
    with c.named(world, "dcp.save of the sharded checkpoint"):
        dcp.save(state, checkpoint_id=str(tmp / ck.SHARDED_DIR))
    final = root / name
    # dcp.save returns once every rank's shard is written, so rank 0 may mark it complete.
    _on_main(world, lambda: _commit(tmp, final, parts), "commit the checkpoint")
    return final


def find(world: World, root: Path, warn: Warn) -> Checkpoint | None:
    """Rank 0 picks and verifies the newest checkpoint that checks out; all ranks read it."""
    found: list[Checkpoint | None] = [None]

    def pick() -> None:
        found[0] = ck.resume_checkpoint(root, warn=warn)

    # One rank chooses, so every rank loads the same checkpoint even if one is damaged.
    _on_main(world, pick, "find a checkpoint to resume")
    picked = None if found[0] is None else str(found[0].path)
    path = c.broadcast(world, picked, "the checkpoint to resume")
    if world.is_main or path is None:
        return found[0]
    return ck.load_checkpoint(Path(path))


def load(
    world: World,
    ckpt: Checkpoint,
    model: nn.Module,
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
) -> None:
    """Read this rank's share of a checkpoint into the model and the optimizer: of a sharded
    one with `dcp.load`, of a single-process (or DDP) one by cutting its whole tensors.

    Raises:
        CheckpointError: its weights are not this model's trainable parameters.
    """
    if not ckpt.sharded:
        _load_whole(ckpt, model, params, optimizer)
        return
    directory = ckpt.path / ck.SHARDED_DIR
    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    # dcp.load fills the tensors of `state` in place, resharded to this world's shapes; so the
    # continuing run may have another number of processes (the data position is global).
    state: dict[str, Any] = {"model": _trainable_state(model)}
    # A checkpoint from before the first update has no optimizer state to ask for.
    with_optim = any(k.startswith("optim.") for k in saved)
    if with_optim:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    with c.named(world, "dcp.load of the sharded checkpoint"):
        try:
            dcp.load(state, checkpoint_id=str(directory))
        except (RuntimeError, KeyError, ValueError) as exc:
            # Only a missing key means another method or model; other failures pass through.
            if "missing" not in str(exc).lower() and not isinstance(exc, KeyError):
                raise
            raise CheckpointError(
                f"{ckpt.path}: checkpoint weights do not match the model's trainable "
                f"parameters (was it written with another method or model?): {exc}"
            ) from exc
    # strict=False: the state holds only the trainable weights, not the frozen base.
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    if with_optim:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    else:
        optimizer.state.clear()  # as the run was when this checkpoint was written


def _load_whole(
    ckpt: Checkpoint,
    model: nn.Module,
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
) -> None:
    """A single-process checkpoint (every rank read the whole file) into the shards: its
    weights by name, its optimizer state from the optimizer's own numbering (the order of
    its parameters, which the same method and model give again) to names."""
    if set(ckpt.weights) != set(params):
        raise CheckpointError(
            f"{ckpt.path}: checkpoint weights do not match the model's trainable parameters "
            "(was it written with another method or model?)"
        )
    prefix = _prefix(model, params)
    # full_state_dict: each rank passes whole tensors and keeps only its shard of them.
    whole = StateDictOptions(full_state_dict=True, strict=False)
    weights: dict[str, Any] = {prefix + name: t for name, t in ckpt.weights.items()}
    set_model_state_dict(model, weights, options=whole)
    # torch.optim numbers parameters by their order in the param groups; DCP wants names.
    name_of = {id(p): prefix + n for n, p in params.items()}
    order = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = ckpt.optimizer
    state: dict[str, Any] = {
        "state": {order[int(i)]: v for i, v in saved["state"].items()},
        "param_groups": [
            {**g, "params": [order[int(i)] for i in g["params"]]} for g in saved["param_groups"]
        ],
    }
    if state["state"]:  # a checkpoint from before the first update: nothing to load
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, state, options=options)


def read_whole(
    ckpt: Checkpoint, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A sharded checkpoint read whole by one process (any world size wrote it): the trainable
    weights by name, and the optimizer state numbered as `optimizer` numbers its parameters,
    ready for `optimizer.load_state_dict` (a single process or DDP continuing an fsdp2 run)."""
    # Through a temporary torch.save file: dcp_to_torch_save needs no process group.
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(ckpt.path / ck.SHARDED_DIR, whole)
        saved = torch.load(whole, map_location="cpu", weights_only=True)
    # Without LossModule's prefix; DCP's trainable-only state dict also holds a frozen head
    # tied to the embeddings (the same values as the base's): only the trainable weights load.
    named = {k.removeprefix("model."): v for k, v in saved["model"].items()}
    weights = {k: v for k, v in named.items() if k in params}
    if "optim" not in saved:  # written before the first update
        return weights, {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
    # The inverse of _load_whole's numbering: DCP's names back to the optimizer's indices.
    name_of = {id(p): n for n, p in params.items()}
    index = {
        name_of[id(p)]: i
        for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])
    }
    optim = saved["optim"]
    state = {index[k.removeprefix("model.")]: v for k, v in optim["state"].items()}
    groups = [
        {**g, "params": [index[k.removeprefix("model.")] for k in g["params"]]}
        for g in optim["param_groups"]
    ]
    return weights, {"state": state, "param_groups": groups}


def _prefix(model: nn.Module, params: dict[str, nn.Parameter]) -> str:
    """What `model`'s names put before the trainable parameters' (the `LossModule` around)."""
    first_name, first = next(iter(params.items()))
    for name, p in model.named_parameters():
        if p is first:
            return name.removesuffix(first_name)
    raise RuntimeError("the trainable parameters are not the model's")


# This rank's shard of a DTensor: checking the whole would gather it from every rank.
def _local(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    return t.to_local() if isinstance(t, DTensor) else t


def _fresh_dir(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    clear(tmp)
    tmp.mkdir()


def _commit(tmp: Path, final: Path, parts: CheckpointParts) -> None:
    """Rank 0, after every shard is on disk: the trainer state, the marker, the rename."""
    trainer_state = {
        "format_version": ck.FORMAT_VERSION,
        "scheduler": parts.scheduler,
        "scaler": parts.scaler,
        "rng": parts.rng,
    }
    path = tmp / ck.TRAINER_STATE_FILE
    with open(path, "wb") as f:
        torch.save(trainer_state, cast(IO[bytes], f))
        f.flush()
        os.fsync(f.fileno())
    write_text_durable(tmp / ck.STATE_JSON_FILE, ck._state_to_json(parts.state))
    files = {}
    for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
        name = file.relative_to(tmp).as_posix()
        files[name] = {"size": file.stat().st_size, verify.HASH: verify.file_digest(file)}
    manifest = {
        "format_version": ck.FORMAT_VERSION,
        "layout": ck.SHARDED_LAYOUT,
        "step": parts.state.step,
        "files": files,
    }
    # Every file, shards included, is listed with its checksum: verification covers them all.
    ck._write_marker(tmp, manifest)
    fsync_dir(tmp / ck.SHARDED_DIR)
    fsync_dir(tmp)
    ck._install(tmp, final)
    ck._rotate(final.parent, parts.keep_last, final)


def _on_main(world: World, work: Any, what: str) -> None:
    """Run `work()` on rank 0, and let every rank know whether it worked: rank 0 raises its own
    error (a `CheckpointWriteError` or `DamagedCheckpoints` keeps its exit code), the others a
    `CheckpointError` naming it."""
    error: Exception | None = None
    if world.is_main:
        try:
            work()
        except Exception as exc:  # every rank must hear of it before anyone raises
            error = exc
    # A string, not the exception: it may not pickle, and the others only need to say it.
    told = c.broadcast(world, None if error is None else f"{type(error).__name__}: {error}", what)
    if error is not None:
        raise error
    if told is not None:
        raise CheckpointError(f"rank {world.rank}: rank 0 could not {what}: {told}")
