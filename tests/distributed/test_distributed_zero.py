"""DeepSpeed ZeRO (dist.strategy=deepspeed): 2-process gloo runs under torchrun on a tiny model.

The same promise as DDP's and FSDP2's (test_distributed.py): 2 processes with micro-batch B
make the same updates as 1 process with micro-batch 2B, here for ZeRO-3 with LoRA and full
fine-tuning; a ZeRO-1 run continues as ZeRO-2 on one process (and, slow, one process as ZeRO-3
on two), since checkpoints are the single-process layout; a guard rollback reloads the
partitions; final/ loads in plain transformers. DeepSpeed is a test dependency (`make
install-test` installs it), so nothing here skips without it. Default-suite cost: about 75 s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dist_support import (
    ONE,
    TWO,
    _args,
    _assert_loads_in_plain_transformers,
    _rank_stdout,
    _refused,
    _torchrun,
    _train_here,
)
from support import _assert_same_run, _ok, _one_process

from leantune.config.dist import DEEPSPEED_INSTALL
from leantune.config.parse import ConfigError
from leantune.monitor.events import read_events
from leantune.monitor.metrics import read_metrics
from leantune.testing.faults import FAULT_RANK_ENV, LOSS_SCALE_ENV, OOM_STEP_ENV, SIGNAL_ENV
from leantune.training.checks import load_config
from leantune.training.state.checkpoint import list_complete_checkpoints, load_checkpoint


# LoRA under ZeRO-3 (42 s here) behind slow: the partitioned update path is the same code as
# full's, which stays in the default suite; LoRA's frozen base under DeepSpeed is in slow.
@pytest.mark.parametrize("method", [pytest.param("lora", marks=pytest.mark.slow), "full"])
def test_zero3_on_two_processes_updates_as_one_with_twice_the_micro_batch(
    tiny_llama_dir: Path,
    dist_train_file: Path,
    dist_reference: dict[str, Path],
    tmp_path: Path,
    method: str,
) -> None:
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, dist_train_file, run_dir, *TWO, f"method.name={method}")
    _ok(_torchrun(2, [*args, "dist.strategy=deepspeed"], log_dir=tmp_path / "logs"))
    _assert_same_run(dist_reference[method], run_dir)
    out = _rank_stdout(tmp_path / "logs")
    assert set(out) == {"0", "1"} and "summary: steps=4" in out["0"]
    ckpts = list_complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002", "step-000004"]
    marker = json.loads((ckpts[-1] / "COMPLETE").read_text())
    assert "layout" not in marker and "model.safetensors" in marker["files"]
    _assert_loads_in_plain_transformers(run_dir / "final", tiny_llama_dir, method)


@pytest.mark.slow  # 29 s: a stage change on resume; resume under ZeRO is in the rollback test
def test_a_zero1_run_continues_as_zero2_on_one_process(
    tiny_llama_dir: Path, dist_train_file: Path, dist_reference: dict[str, Path], tmp_path: Path
) -> None:
    """2 -> 1 processes and another stage: ZeRO-1 on 2 processes, stopped by SIGTERM after
    step 2, continued by ZeRO-2 on a world of one (`dist.strategy=deepspeed` without torchrun)
    equals the uninterrupted one-process run. The checkpoint holds the gathered weights and
    Adam state in the single-process layout."""
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, dist_train_file, run_dir, "dist.strategy=deepspeed")
    done = _torchrun(2, [*args, *TWO, "dist.zero_stage=1"], **{SIGNAL_ENV: "4:TERM"})
    assert done.returncode != 0 and "stopped before step 3" in done.stderr, done.stderr[-3000:]
    ckpt = list_complete_checkpoints(run_dir / "checkpoints")[-1]
    assert ckpt.name == "step-000002" and not load_checkpoint(ckpt).sharded
    done = _one_process([*args, *ONE, "dist.zero_stage=2"])
    _ok(done)
    assert "resumed from" in done.stdout
    _assert_same_run(dist_reference["lora"], run_dir)


@pytest.mark.slow
def test_a_single_process_run_continues_as_zero3_on_two_processes(
    tiny_llama_dir: Path, dist_train_file: Path, dist_reference: dict[str, Path], tmp_path: Path
) -> None:
    """1 -> 2 processes: one process without DeepSpeed, stopped after step 2, continued by
    ZeRO-3 on 2 processes equals the uninterrupted run (Adam's state made on the partitions)."""
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, dist_train_file, run_dir)
    done = _one_process([*args, *ONE], **{SIGNAL_ENV: "2:TERM"})
    assert done.returncode == 143, done.stderr[-3000:]
    done = _torchrun(2, [*args, *TWO, "dist.strategy=deepspeed", "dist.zero_stage=3"])
    _ok(done)
    assert "resumed from" in done.stdout
    _assert_same_run(dist_reference["lora"], run_dir)


@pytest.mark.slow
def test_a_nan_on_one_rank_skips_the_step_on_every_rank_under_zero3(
    tiny_llama_dir: Path, dist_train_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's skip discards ZeRO's partitioned gradients: the next step starts clean."""
    one, two = tmp_path / "one", tmp_path / "two"
    monkeypatch.setenv(LOSS_SCALE_ENV, "2:nan")
    _train_here(tiny_llama_dir, dist_train_file, one)
    monkeypatch.delenv(LOSS_SCALE_ENV)
    args = _args(tiny_llama_dir, dist_train_file, two, *TWO, "dist.strategy=deepspeed")
    _ok(_torchrun(2, args, **{LOSS_SCALE_ENV: "2:nan", FAULT_RANK_ENV: "1"}))
    kinds = [(e["kind"], e["step"]) for e in read_events(two / "events.jsonl")]
    assert ("nonfinite", 2) in kinds
    _assert_same_run(one, two)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_an_out_of_memory_error_on_one_rank_replays_the_window_under_zero(
    tiny_llama_dir: Path,
    dist_train_file: Path,
    dist_reference: dict[str, Path],
    tmp_path: Path,
    stage: int,
) -> None:
    """The abandoned micro-batch's gradients are discarded before the replay."""
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, dist_train_file, run_dir, *TWO, "dist.strategy=deepspeed")
    _ok(
        _torchrun(
            2, [*args, f"dist.zero_stage={stage}"], **{OOM_STEP_ENV: "2", FAULT_RANK_ENV: "1"}
        )
    )
    assert [r["micro_batch_size"] for r in read_metrics(run_dir / "metrics.jsonl")] == [2, 1, 1, 1]
    _assert_same_run(dist_reference["lora"], run_dir)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dist.zero_stage=2"], "dist.zero_stage is a deepspeed setting"),
        (["dist.strategy=deepspeed", "dist.zero_stage=4"], "dist.zero_stage: 1, 2 or 3, got 4"),
        (["dist.strategy=deepspeed", "train.optimizer=adamw_8bit"], "train.optimizer=adamw_8bit"),
        (["dist.strategy=deepspeed", "method.name=qlora"], "deepspeed with method.name=qlora"),
        (
            ["dist.strategy=deepspeed", "train.eval_every=2", "data.eval={eval}"],
            "train.eval_every with dist.strategy=deepspeed and dist.zero_stage=3",
        ),
    ],
)
def test_deepspeed_settings_are_checked_before_anything_runs(
    overrides: list[str], message: str, tmp_path: Path
) -> None:
    _refused(overrides, message, tmp_path)


def test_fp16_is_refused_with_deepspeed() -> None:
    from leantune.config.dist import DistConfig, check_deepspeed

    with pytest.raises(ConfigError, match=r"train\.precision=fp16 with dist\.strategy=deepspeed"):
        check_deepspeed(DistConfig(strategy="deepspeed"), "fp16", "adamw", "lora", False)


def test_without_deepspeed_installed_the_error_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name)
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, ["dist.strategy=deepspeed"])
    assert "dist.strategy=deepspeed needs DeepSpeed" in str(err.value)
    assert DEEPSPEED_INSTALL in str(err.value)
    assert DEEPSPEED_INSTALL == "pip install --no-build-isolation 'deepspeed==0.19.8'"


def test_a_rank_whose_deepspeed_sees_another_world_than_torchrun_started_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher trap (one process started where two were asked for), seen from DeepSpeed's
    side: its data-parallel world must be the process group's."""
    import types

    import deepspeed
    import torch

    from leantune.training.parallel.world import World, WorldSizeMismatch
    from leantune.training.parallel.zero import ZeroStrategy, engine_config

    assert engine_config(2, 1.0)["zero_optimization"] == {"stage": 2}
    assert engine_config(3, 0.0)["gradient_clipping"] == 0.0
    assert engine_config(3, 0.5)["gradient_accumulation_steps"] == 1  # the loop accumulates
    engine = types.SimpleNamespace(dp_world_size=1)
    monkeypatch.setattr(deepspeed, "initialize", lambda **_: (engine, None, None, None))
    world = World(0, 2, 0, torch.device("cpu"), None, 1.0)  # type: ignore[arg-type]
    strategy = ZeroStrategy(world, zero_stage=3, max_grad_norm=1.0)
    strategy.wrap_model(torch.nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(WorldSizeMismatch, match="DeepSpeed sees 1 data-parallel processes"):
        strategy.prepare_optimizer(optimizer)


@pytest.mark.parametrize(
    ("stage", "nan_step"),
    [
        (3, 4),
        pytest.param(1, 4, marks=pytest.mark.slow),
        pytest.param(1, 2, marks=pytest.mark.slow),
    ],
)
def test_a_rollback_reloads_the_checkpoint_into_the_partitions(
    tiny_llama_dir: Path,
    dist_train_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stage: int,
    nan_step: int,
) -> None:
    """A NaN with guard.nonfinite=rollback: the checkpoint before it (step 2; step 0, before any
    update, for a NaN at step 2) is put back into ZeRO's partitions mid-run (ZeRO-3's small,
    always-gathered parameters and ZeRO-1's links to Adam's state included) and the run
    continues as one process's does."""
    one, two = tmp_path / "one", tmp_path / "two"
    guard = ("guard.nonfinite=rollback",)
    monkeypatch.setenv(LOSS_SCALE_ENV, f"{nan_step}:nan")
    _train_here(tiny_llama_dir, dist_train_file, one, *guard)
    monkeypatch.delenv(LOSS_SCALE_ENV)
    args = _args(tiny_llama_dir, dist_train_file, two, *TWO, *guard, "dist.strategy=deepspeed")
    args.append(f"dist.zero_stage={stage}")
    _ok(_torchrun(2, args, **{LOSS_SCALE_ENV: f"{nan_step}:nan", FAULT_RANK_ENV: "1"}))
    kinds = [(e["kind"], e["step"]) for e in read_events(two / "events.jsonl")]
    assert kinds == [(e["kind"], e["step"]) for e in read_events(one / "events.jsonl")]
    assert any(kind == "rollback" for kind, _ in kinds), kinds
    _assert_same_run(one, two)


def test_deepspeed_gets_a_local_rank_only_for_its_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed insists on a launcher's LOCAL_RANK, which a world of one has not: it is set for
    `deepspeed.initialize` and taken back, so later code in the process (accelerate, which then
    tries to join a process group that does not exist) does not think a launcher started it."""
    import types

    import deepspeed
    import torch

    from leantune.training.parallel.world import World
    from leantune.training.parallel.zero import ZeroStrategy

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen: list[str | None] = []

    def initialize(**_: object) -> tuple[object, None, None, None]:
        seen.append(os.environ.get("LOCAL_RANK"))
        return types.SimpleNamespace(dp_world_size=1), None, None, None

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    world = World(0, 1, 0, torch.device("cpu"), None, 1.0)  # type: ignore[arg-type]
    strategy = ZeroStrategy(world, zero_stage=2, max_grad_norm=1.0)
    strategy.wrap_model(torch.nn.Linear(2, 2))
    strategy.prepare_optimizer(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    assert seen == ["0"] and "LOCAL_RANK" not in os.environ
