"""Data parallelism on this machine: 2-process gloo runs under torchrun on a tiny model.

The promise checked here: 2 processes with micro-batch B make the same updates as 1 process
with micro-batch 2B (the same global batch of 8), for DDP and FSDP2, LoRA and full fine-tuning,
through a NaN on one rank, a resume at another world size and a killed rank restarted by
torchrun; and what rank 0 writes (checkpoints, final/) is what plain tools read.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
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
from support import _assert_same_run, _env, _ok, _one_process, chat_rows, write_jsonl

from leantune.errors import UserError
from leantune.methods.registry import METHODS
from leantune.monitor.events import read_events
from leantune.monitor.metrics import read_metrics
from leantune.testing.faults import (
    FAULT_RANK_ENV,
    KILL_ENV,
    LOSS_SCALE_ENV,
    OOM_STEP_ENV,
    SIGNAL_ENV,
)
from leantune.training.checks import load_config
from leantune.training.state.checkpoint import (
    CheckpointError,
    list_complete_checkpoints,
    load_checkpoint,
)


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_update_as_one_with_twice_the_micro_batch(
    tiny_llama_dir: Path,
    dist_train_file: Path,
    dist_reference: dict[str, Path],
    tmp_path: Path,
    strategy: str,
    method: str,
) -> None:
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, dist_train_file, run_dir, *TWO, f"method.name={method}")
    _ok(_torchrun(2, [*args, f"dist.strategy={strategy}"], log_dir=tmp_path / "logs"))
    _assert_same_run(dist_reference[method], run_dir)
    # Rank 0 alone speaks (each rank's output in its own file) and writes the run's files.
    out = _rank_stdout(tmp_path / "logs")
    assert set(out) == {"0", "1"} and "summary: steps=4" in out["0"] and out["1"] == ""
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not list(tmp_path.glob("**/.tmp-*"))
    ckpts = list_complete_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step-000002", "step-000004"]
    marker = json.loads((ckpts[-1] / "COMPLETE").read_text())
    if strategy == "fsdp2":  # DCP shards, each in the marker with its checksum
        assert marker["layout"] == "sharded"
        assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(marker["files"])
    else:  # replicated state: the single-process layout, written once
        assert "layout" not in marker and "model.safetensors" in marker["files"]
    _assert_loads_in_plain_transformers(run_dir / "final", tiny_llama_dir, method)


@pytest.mark.slow  # 23 s: FSDP2's ignored-params path; the 2-process fsdp2 LoRA test stays
def test_qlora_on_two_fsdp2_processes_updates_as_one_keeping_the_4bit_base_whole(
    tiny_llama_dir: Path, dist_train_file: Path, tmp_path: Path
) -> None:
    """The packed 4-bit base weights cannot be cut into shards: they are FSDP's ignored
    parameters, whole on every rank, and the LoRA matrices (everything trainable) are sharded.
    Stopped after step 2 and continued, the run is one process's; its sharded checkpoint holds
    no 4-bit weight nor quantisation state."""
    one, two = tmp_path / "one", tmp_path / "two"
    _train_here(tiny_llama_dir, dist_train_file, one, "method.name=qlora")
    args = _args(tiny_llama_dir, dist_train_file, two, *TWO, "method.name=qlora")
    args.append("dist.strategy=fsdp2")
    done = _torchrun(2, args, **{SIGNAL_ENV: "4:TERM"})  # the 1st micro-batch of step 3
    assert done.returncode != 0 and "stopped before step 3" in done.stderr
    done = _torchrun(2, args)
    _ok(done)
    assert "resumed from" in done.stdout
    _assert_same_run(one, two)
    ckpt = list_complete_checkpoints(two / "checkpoints")[-1]
    marker = json.loads((ckpt / "COMPLETE").read_text())
    assert marker["layout"] == "sharded" and "dcp/__1_0.distcp" in marker["files"]
    assert load_checkpoint(ckpt).sharded
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights
    _assert_loads_in_plain_transformers(two / "final", tiny_llama_dir, "qlora")


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_evaluation_on_two_processes_equals_one_process(
    tiny_llama_dir: Path, dist_train_file: Path, tmp_path: Path, strategy: str
) -> None:
    """Base exact match, periodic evaluation (ddp) and the closing evaluation; a run named
    run.name=auto (the name is derived before the process group needs the run directory)."""
    eval_file = write_jsonl(tmp_path / "eval.jsonl", chat_rows(6, offset=100))
    evals = [f"data.eval={eval_file}", "train.eval_exact_match=true", "train.max_new_tokens=8"]
    evals += ["train.eval_every=2"] if strategy == "ddp" else []
    one = tmp_path / "one"
    _train_here(tiny_llama_dir, dist_train_file, one, *evals)
    args = _args(
        tiny_llama_dir, dist_train_file, tmp_path, *TWO, *evals, f"dist.strategy={strategy}"
    )
    args = [a for a in args if not a.startswith("run.dir=")] + ["run.name=auto"]
    _ok(_torchrun(2, args, cwd=tmp_path))
    (two,) = (tmp_path / "runs").iterdir()
    sa = json.loads((one / "summary.json").read_text())
    sb = json.loads((two / "summary.json").read_text())
    keys = ["eval_loss", "eval_perplexity", "eval_exact_match", "base_exact_match"]
    assert all(k in sb for k in keys)
    assert [sb[k] for k in keys] == pytest.approx([sa[k] for k in keys], rel=1e-4)
    if strategy == "ddp":
        ea, eb = read_metrics(one / "eval.jsonl"), read_metrics(two / "eval.jsonl")
        assert [r["step"] for r in eb] == [2, 4]
        assert [r["eval_loss"] for r in eb] == pytest.approx([r["eval_loss"] for r in ea], rel=1e-4)


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(
    tiny_llama_dir: Path, dist_train_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    monkeypatch.setenv(LOSS_SCALE_ENV, "2:nan")
    _train_here(tiny_llama_dir, dist_train_file, one)
    monkeypatch.delenv(LOSS_SCALE_ENV)
    args = _args(tiny_llama_dir, dist_train_file, two, *TWO, "dist.strategy=ddp")
    _ok(_torchrun(2, args, **{LOSS_SCALE_ENV: "2:nan", FAULT_RANK_ENV: "1"}))
    kinds = [(e["kind"], e["step"]) for e in read_events(two / "events.jsonl")]
    assert kinds == [(e["kind"], e["step"]) for e in read_events(one / "events.jsonl")]
    assert ("nonfinite", 2) in kinds
    # Rank 0's own loss was finite: it skipped because rank 1's was not, and the weights on
    # both ranks stayed one model (rank 0's final/ equals the one-process run's).
    _assert_same_run(one, two)


# DDP's is slow: both strategies decide through the same OverWorld.agree.
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])
def test_an_out_of_memory_error_on_one_rank_halves_the_micro_batch_on_every_rank(
    tiny_llama_dir: Path,
    dist_train_file: Path,
    dist_reference: dict[str, Path],
    tmp_path: Path,
    strategy: str,
) -> None:
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, dist_train_file, run_dir, *TWO, f"dist.strategy={strategy}")
    _ok(_torchrun(2, args, **{OOM_STEP_ENV: "2", FAULT_RANK_ENV: "1"}))
    ooms = [e for e in read_events(run_dir / "events.jsonl") if e["kind"] == "oom"]
    # Rank 0 speaks for the run: its micro-batch was halved for rank 1's error.
    assert [(e["step"], e["micro_batch_size"]) for e in ooms] == [(2, 1)]
    assert "out of memory on another process" in ooms[0]["error"]
    assert [r["micro_batch_size"] for r in read_metrics(run_dir / "metrics.jsonl")] == [2, 1, 1, 1]
    _assert_same_run(dist_reference["lora"], run_dir)  # the replay equals the planned window


# Both slow (the default suite's budget): 2 -> 1 and 1 -> 2 with FSDP2 shards stay in the default
# suite through test_checkpoints_continue_across_single_process_and_fsdp2 below.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_run_continues_at_another_world_size(
    tiny_llama_dir: Path,
    dist_train_file: Path,
    dist_reference: dict[str, Path],
    tmp_path: Path,
    strategy: str,
) -> None:
    """2 -> 1 and 1 -> 2 processes: stopped by SIGTERM after step 2 (both ranks stop alike,
    with a checkpoint), continued at the other world size; the result is the uninterrupted
    one-process run's. DDP's checkpoints are the single-process layout, so its one process is
    a plain run; FSDP2's one process is a world of one reading the shards."""
    one = ["dist.strategy=fsdp2"] if strategy == "fsdp2" else []
    two = [f"dist.strategy={strategy}"]
    stop_after_step_2 = {SIGNAL_ENV: "4:TERM"}  # the 1st micro-batch of step 3, on each rank
    run_dir = tmp_path / "two_then_one"
    args = _args(tiny_llama_dir, dist_train_file, run_dir)
    done = _torchrun(2, [*args, *TWO, *two], **stop_after_step_2)
    assert done.returncode != 0 and "stopped before step 3" in done.stderr
    assert list_complete_checkpoints(run_dir / "checkpoints")[-1].name == "step-000002"
    _ok(_one_process([*args, *ONE, *one]))
    _assert_same_run(dist_reference["lora"], run_dir)

    run_dir = tmp_path / "one_then_two"
    args = _args(tiny_llama_dir, dist_train_file, run_dir)
    done = _one_process([*args, *ONE, *one], **{SIGNAL_ENV: "2:TERM"})
    assert done.returncode == 143, done.stderr[-3000:]
    _ok(_torchrun(2, [*args, *TWO, *two]))
    _assert_same_run(dist_reference["lora"], run_dir)


# 37 s, four launches; a sharded checkpoint resumed under fsdp2 stays in the default suite
# (test_a_killed_rank_is_restarted_...), the whole<->sharded conversion is in slow.
@pytest.mark.slow
def test_checkpoints_continue_across_single_process_and_fsdp2(
    tiny_llama_dir: Path, dist_train_file: Path, dist_reference: dict[str, Path], tmp_path: Path
) -> None:
    """A single process's checkpoint under 2 fsdp2 processes (its whole weights and optimizer
    state, numbered by parameter order, cut into shards), and 2 fsdp2 processes' sharded
    checkpoint under a single process (read whole): both equal the uninterrupted run."""
    run_dir = tmp_path / "single_then_fsdp2"
    args = _args(tiny_llama_dir, dist_train_file, run_dir)
    done = _one_process([*args, *ONE], **{SIGNAL_ENV: "2:TERM"})
    assert done.returncode == 143, done.stderr[-3000:]
    assert not load_checkpoint(list_complete_checkpoints(run_dir / "checkpoints")[-1]).sharded
    done = _torchrun(2, [*args, *TWO, "dist.strategy=fsdp2"])
    _ok(done)
    assert "resumed from" in done.stdout
    _assert_same_run(dist_reference["lora"], run_dir)
    assert load_checkpoint(list_complete_checkpoints(run_dir / "checkpoints")[-1]).sharded

    run_dir = tmp_path / "fsdp2_then_single"
    args = _args(tiny_llama_dir, dist_train_file, run_dir)
    done = _torchrun(2, [*args, *TWO, "dist.strategy=fsdp2"], **{SIGNAL_ENV: "4:TERM"})
    assert done.returncode != 0 and "stopped before step 3" in done.stderr
    assert load_checkpoint(list_complete_checkpoints(run_dir / "checkpoints")[-1]).sharded
    done = _one_process([*args, *ONE])
    _ok(done)
    assert "resumed from" in done.stdout
    _assert_same_run(dist_reference["lora"], run_dir)


def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_resumes(
    tiny_llama_dir: Path, dist_train_file: Path, dist_reference: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, dist_train_file, run_dir, *TWO, "dist.strategy=fsdp2")
    command = [sys.executable, "-m", "leantune", "train", "--nproc", "2", "--max-restarts", "1"]
    # SIGKILL rank 1 in step 3 (its 6th micro-batch), on torchrun's first attempt only.
    env = _env(**{KILL_ENV: "5", FAULT_RANK_ENV: "1"})
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=300)
    _ok(done)
    assert "(exitcode: -9) local_rank: 1" in done.stderr  # torchrun saw the kill
    # Rank 0, waiting for rank 1 in a collective, never hangs there: either gloo saw the lost
    # peer first and rank 0 said where, or torchrun's monitor saw the dead rank first and closed
    # rank 0 (SIGTERM) before gloo did. Which comes first is a race between torchrun and gloo
    # that no rank decides (under load the second won, and the report was missing). A failed
    # collective's report is tested on its own: test_a_hung_collective_times_out_naming_...
    reported = "CollectiveFailed: rank 0 of 2:" in done.stderr
    closed = re.search(r"Sending process \d+ closing signal SIGTERM", done.stderr) is not None
    assert reported or closed, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "step 2" in done.stdout
    _assert_same_run(dist_reference["lora"], run_dir)


# 19 s; a damaged file in a whole checkpoint is refused in the default suite
# (tests/unit/training/test_checkpoint_integrity.py); the shard's refusal by every rank in slow.
@pytest.mark.slow
def test_a_damaged_shard_is_refused(
    tiny_llama_dir: Path, dist_train_file: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, dist_train_file, run_dir, *TWO, "dist.strategy=fsdp2")
    _ok(_torchrun(2, [*args, "train.max_steps=2"]))
    ckpt = list_complete_checkpoints(run_dir / "checkpoints")[-1]
    assert load_checkpoint(ckpt).sharded
    shard = ckpt / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp with sha256"):
        load_checkpoint(ckpt)
    # Resuming it: rank 0 refuses as a single process would (exit 2), rank 1 says why it stops.
    done = _torchrun(2, [*args, "train.max_steps=2"])
    assert done.returncode != 0
    assert "error: rank 0 of 2: no checkpoint in" in done.stderr
    assert "__1_0.distcp with sha256" in done.stderr
    assert "rank 1: rank 0 could not find a checkpoint to resume" in done.stderr


def test_torchrun_with_another_world_size_than_asked_fails_on_every_rank(
    tiny_llama_dir: Path, dist_train_file: Path, tmp_path: Path
) -> None:
    args = _args(tiny_llama_dir, dist_train_file, tmp_path / "run", *TWO, "dist.strategy=ddp")
    done = _torchrun(2, args, LEANTUNE_EXPECTED_WORLD_SIZE="3")
    assert done.returncode != 0
    for rank in (0, 1):
        assert f"error: rank {rank} of 2: rank {rank}: asked for 3 processes" in done.stderr


HANG = """
import time, torch.distributed as dist
from leantune.training.parallel import collectives as c
from leantune.training.parallel.world import init_world
world = init_world("gloo", "cpu", 5.0)
if world.rank == 1:
    time.sleep(10)  # never joins rank 0's all-reduce within the timeout
else:
    try:
        c.sum_int(world, 1, "the window's supervised-token count")
    except c.CollectiveFailed as exc:
        print("FAILED:", exc, flush=True)
"""


def test_a_hung_collective_times_out_naming_the_rank_and_the_operation(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", str(script)]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    line = next(x for x in done.stdout.splitlines() if x.startswith("FAILED:"))
    assert "rank 0 of 2: all_reduce of the window's supervised-token count" in line
    assert "did not complete within dist.timeout_s=5s" in line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dist.cpu_offload=true"], "dist.cpu_offload and dist.reshard_after_forward are fsdp2"),
        (["dist.timeout_s=0"], "dist.timeout_s: must be > 0"),
        (["dist.strategy=fsdp2", "dist.cpu_offload=true", "train.device=cpu"], "needs CUDA"),
        (["dist.backend=nccl", "train.device=cpu"], "dist.backend=nccl needs CUDA"),
        (
            ["dist.strategy=fsdp2", "train.eval_every=2", "data.eval={eval}"],
            "train.eval_every with dist.strategy=fsdp2",
        ),
        (["dist.strategy=zero3"], "dist.strategy"),
    ],
)
def test_dist_settings_are_checked_before_anything_runs(
    overrides: list[str], message: str, tmp_path: Path
) -> None:
    _refused(overrides, message, tmp_path)


def test_a_window_that_does_not_divide_over_the_ranks_is_refused() -> None:
    from leantune.training.parallel.collectives import shard
    from leantune.training.parallel.world import World

    worlds = [World(r, 2, r, torch.device("cpu"), None, 1.0) for r in (0, 1)]  # type: ignore[arg-type]
    assert [shard(list(range(8)), w) for w in worlds] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="multiple of 2"):
        shard(list(range(7)), worlds[0])


METHOD_CASES = [(strategy, method) for strategy in ("ddp", "fsdp2") for method in METHODS]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "method"), METHOD_CASES)
def test_every_method_trains_on_two_processes_as_on_one(
    tiny_llama_dir: Path, dist_train_file: Path, tmp_path: Path, strategy: str, method: str
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    extra = (f"method.name={method}", "train.max_steps=2")
    _train_here(tiny_llama_dir, dist_train_file, one, *extra)
    args = _args(tiny_llama_dir, dist_train_file, two, *TWO, *extra)
    _ok(_torchrun(2, [*args, f"dist.strategy={strategy}"]))
    ra, rb = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], rel=1e-4)
    assert [r["grad_norm"] for r in ra] == pytest.approx([r["grad_norm"] for r in rb], rel=1e-3)
    assert (two / "final").is_dir() and (two / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_demo_model_on_two_processes(tmp_path: Path, strategy: str) -> None:
    """SmolLM2-135M, LoRA, the demo's data packed to 512 tokens: 2 processes x 1 row per step
    against 1 process x 2 rows, 6 steps; then the adapter loads in plain PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from leantune.models.loading import resolve_model

    common = ["run.progress=false", "train.max_steps=6", "train.save_every=3",
              "train.eval_exact_match=false", "train.precision=fp32",
              "method.dropout=0"]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    _ok(_one_process([*common, f"run.dir={one}", "train.micro_batch_size=2"]))
    args = [*common, f"run.dir={two}", "train.micro_batch_size=1", "train.grad_accum=2"]
    _ok(_torchrun(2, [*args, f"dist.strategy={strategy}"]))
    ra, rb = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], rel=1e-4)
    assert rb[-1]["loss"] < rb[0]["loss"]
    base = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct").location)
    model = PeftModel.from_pretrained(base, two / "final")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in model.state_dict().items())


def test_fsdp_units_are_the_blocks_and_the_trainable_leaves_of_another_dtype(
    tiny_llama_dir: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    from leantune.methods.registry import apply_method
    from leantune.training.parallel.fsdp import odd_dtype_leaves, transformer_blocks

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    model = apply_method(base, load_config(None, ["method.name=lora"]).method)
    blocks = transformer_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    names = {m: n for n, m in blocks[0].named_modules()}
    leaves = odd_dtype_leaves(blocks[0])
    # The fp32 LoRA A and B matrices of every adapted projection, nothing of the bf16 base.
    assert leaves and all(names[m].split(".")[-2] in ("lora_A", "lora_B") for m in leaves)
    assert {p.dtype for m in leaves for p in m.parameters()} == {torch.float32}
    adapted = [n for n, p in blocks[0].named_parameters() if p.requires_grad]
    assert len(adapted) == sum(len(list(m.parameters())) for m in leaves)
    # One dtype throughout (fp32 base): the block is one unit with its adapters.
    fp32 = apply_method(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
        load_config(None, ["method.name=lora"]).method,
    )
    assert odd_dtype_leaves(transformer_blocks(fp32)[0]) == []


def test_nproc_execs_torchrun_with_the_world_size_it_asks_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from leantune.training.parallel import launch

    seen: dict[str, Any] = {}
    monkeypatch.setattr(launch.os, "execve", lambda *a: seen.update(argv=a[1], env=a[2]))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("leantune.core.threads.usable_physical_cores", lambda: 8)
    launch.exec_torchrun(3, 2, ["train", "cfg.yaml", "train.lr=1e-4"])
    assert seen["env"]["OMP_NUM_THREADS"] == "2"  # 8 cores shared by 3 ranks
    assert seen["argv"] == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
        "--max-restarts=2", "-m", "leantune", "train", "cfg.yaml", "train.lr=1e-4",
    ]  # fmt: skip
    assert seen["env"][launch.EXPECTED_WORLD_ENV] == "3"
    assert seen["env"][launch.NO_SHARED_STORE_ENV] == "1"
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match="--nproc inside a torchrun process"):
        launch.exec_torchrun(2, 0, ["train"])
    assert launch.rank_tag() == "rank 0 of 2: "
