"""run.resume=auto|never|force: a run directory resumes only the run its config describes.

Each run directory records a fingerprint of what decides its trajectory (leantune_run.json).
`auto` resumes only a matching run and otherwise exits 2 listing the changed fields; `force`
accepts the changes whose weights still load and says what each means; `never` moves an old
run aside instead of mixing it with the new one.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import run_cli, save_tiny_model, tiny_train_args, write_jsonl

from leantune.core.signals import Interrupted
from leantune.monitor.metrics import read_metrics
from leantune.training.checks import load_config
from leantune.training.recipe import train
from leantune.training.run.fingerprint import Fingerprint, compare, trajectory_settings
from leantune.training.run.resume import ResumePlan, RunMismatch, plan_resume
from leantune.training.run.rundir import RunRecord

SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_MICRO_BATCH"


def chat_rows(n: int, offset: int = 0) -> list[dict]:
    items = ["lamp", "desk", "phone", "cable", "chair", "mouse"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Order {i} for a {items[i % 6]}, status?"},
                {"role": "assistant", "content": json.dumps({"item": items[i % 6], "id": i})},
            ]
        }
        for i in range(offset, offset + n)
    ]


def alpaca_rows(n: int) -> list[dict]:
    return [
        {"instruction": f"Name item {i}.", "input": "", "output": f"item {i}"} for i in range(n)
    ]


@pytest.fixture()
def chat_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))


def args(model: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_train_args(
        model, data, run_dir, "train.max_steps=4", "train.seed=3", "train.save_every=2", *extra
    )


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_new_user_chat_then_alpaca_in_the_same_named_run_dir_is_refused(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's command twice with the same run.name, first with a chat file, then with an
    alpaca file. (Without run.name the two get two run directories: test_defaults.py.)"""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(12))
    tiny = [
        f"model.path={tiny_llama_dir}",
        "data.eval=null",
        "train.eval_exact_match=false",
        "train.max_steps=3",
        "run.progress=false",
        "run.name=mine",
    ]
    first = run_cli(["train", "data.train=chat.jsonl", "data.format=chat", *tiny])
    assert first.code == 0, first.err
    run = tmp_path / "runs" / "mine"
    before = snapshot(run / "final")
    config_before = (run / "config.yaml").read_text()
    second = run_cli(["train", "data.train=alpaca.jsonl", "data.format=alpaca", *tiny])
    assert second.code == 2, second
    assert "data.format: chat -> alpaca" in second.err
    assert "data.train: chat.jsonl" in second.err and "-> alpaca.jsonl" in second.err
    assert "run.name" in second.err and "run.resume=force" in second.err
    assert "resumed" not in second.out
    assert snapshot(run / "final") == before
    assert (run / "config.yaml").read_text() == config_before


def _base_run(model: Path, data: Path, run: Path) -> None:
    result = run_cli(args(model, data, run))
    assert result.code == 0, result.err


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("train.lr=5e-3", "train.lr: 0.01 -> 0.005"),
        ("train.seed=4", "train.seed: 3 -> 4"),
        ("train.grad_accum=2", "train.global_batch: 2 -> 4"),
        ("data.max_seq_len=96", "data.max_seq_len: 128 -> 96"),
        ("train.max_steps=6", "train.max_steps: 4 -> 6"),
        ("method.dropout=0.1", "method.dropout: null -> 0.1"),
        ("train.warmup_ratio=0.5", "train.warmup_ratio: 0.1 -> 0.5"),
        ("train.weight_decay=0.1", "train.weight_decay: 0.01 -> 0.1"),
    ],
)
def test_auto_refuses_a_changed_setting_and_names_it(
    override: str, field: str, tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    before = snapshot(run)
    result = run_cli(args(tiny_llama_dir, chat_file, run, override))
    assert result.code == 2, result
    assert field in result.err
    assert "run.resume=force" in result.err and "run.dir" in result.err
    assert snapshot(run) == before  # refused before writing anything


def test_other_data_and_another_base_with_the_same_shapes_are_refused(
    tiny_llama_dir: Path, tokenizer_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    other_data = write_jsonl(tmp_path / "other.jsonl", chat_rows(16, offset=50))
    result = run_cli(args(tiny_llama_dir, other_data, run))
    assert result.code == 2 and "data.train: chat.jsonl" in result.err, result
    twin = save_tiny_model(tmp_path / "twin", "llama", tokenizer_dir, seed=1)
    result = run_cli(args(twin, chat_file, run))
    assert result.code == 2 and "model.files" in result.err, result


def test_unchanged_run_and_settings_outside_the_trajectory_resume(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    free = [
        "train.save_every=1",
        "train.keep_last=3",
        "guard.grad_norm=skip",
        "train.eval_batch_size=4",
        "run.progress=true",
    ]
    result = run_cli(args(tiny_llama_dir, chat_file, run, *free))
    assert result.code == 0, result.err
    assert "resumed from" in result.out


def test_another_micro_batch_split_of_the_same_global_batch_resumes_bit_exact(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    # fp32: another split sums the same losses in another order, equal to fp32 rounding; bf16
    # autocast (auto on an AMX CPU) rounds each micro-batch's matmuls (1.2e-5 apart here).
    fp32 = ["train.precision=fp32"]
    split = ["train.max_steps=4", "train.micro_batch_size=2", "train.grad_accum=2", *fp32]
    for name in ("a", "b"):
        code = run_cli(args(tiny_llama_dir, chat_file, tmp_path / name, *split)).code
        assert code == 0
    # Go back to step 2 in b, then resume it with 1 x 4 instead of 2 x 2.
    b = tmp_path / "b"
    shutil.rmtree(b / "checkpoints" / "step-000004")
    shutil.rmtree(b / "final")
    other = ["train.max_steps=4", "train.micro_batch_size=1", "train.grad_accum=4", *fp32]
    result = run_cli(args(tiny_llama_dir, chat_file, b, *other))
    assert result.code == 0, result.err
    assert "micro-batch split 2 x 2 -> 1 x 4" in result.out
    a_rows, b_rows = (
        read_metrics(tmp_path / "a" / "metrics.jsonl"),
        read_metrics(b / "metrics.jsonl"),
    )
    assert [m["step"] for m in b_rows] == [1, 2, 3, 4]
    for x, y in zip(a_rows[2:], b_rows[2:], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["lr"] == x["lr"]


def test_force_refuses_weights_that_cannot_load_naming_the_fields(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    before = snapshot(run / "checkpoints")
    cases = [
        (tiny_llama_dir, ["method.r=8"], "method.r: null -> 8"),
        (tiny_llama_dir, ["method.name=full", "train.lr=1e-3"], "method.name: lora -> full"),
        (tiny_llama_dir, ["method.target_modules=[q_proj]"], "method.target_modules"),
        (tiny_qwen2_dir, [], "model.architecture"),
    ]
    for model, extra, field in cases:
        result = run_cli(args(model, chat_file, run, *extra, "run.resume=force"))
        assert result.code == 2, (extra, result)
        assert field in result.err and "even with run.resume=force" in result.err, result.err
        assert "size mismatch" not in result.err
    assert snapshot(run / "checkpoints") == before


def test_force_with_a_new_lr_takes_effect_and_says_so(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    final_before = load_file(run / "final" / "adapter_model.safetensors")
    new = ["train.lr=5e-3", "train.max_steps=6", "run.resume=force"]
    result = run_cli(args(tiny_llama_dir, chat_file, run, *new))
    assert result.code == 0, result.err
    assert "train.lr: 0.01 -> 0.005" in result.out and "train.max_steps: 4 -> 6" in result.out
    rows = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    # The finished run was at its floor (min_lr_ratio 0.1 of 1e-2); the continuation stays at
    # the floor of the new peak: 0.1 x 5e-3.
    assert rows[3]["lr"] == pytest.approx(1e-2 * warm_floor(4, 3))
    assert [m["lr"] for m in rows[4:]] == pytest.approx([5e-4, 5e-4])
    final_after = load_file(run / "final" / "adapter_model.safetensors")
    assert any(not torch.equal(final_before[k], final_after[k]) for k in final_before)
    # The forced resume recorded the new settings: the same command resumes without force.
    again = run_cli(args(tiny_llama_dir, chat_file, run, "train.lr=5e-3", "train.max_steps=6"))
    assert again.code == 0, again.err


def warm_floor(max_steps: int, step: int) -> float:
    """The default schedule's multiplier (warmup 10%, floor 0.1) at 0-based `step`."""
    from leantune.core.optim import warmup_cosine

    return warmup_cosine(step, max_steps, round(max_steps * 0.1), 0.1)


def test_force_on_a_finished_run_with_only_a_new_lr_trains_nothing_and_says_why(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    result = run_cli(args(tiny_llama_dir, chat_file, run, "train.lr=5e-3", "run.resume=force"))
    assert result.code == 0, result.err
    assert "nothing left to train" in result.out


def test_force_below_the_current_step_is_refused(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    result = run_cli(args(tiny_llama_dir, chat_file, run, "train.max_steps=3", "run.resume=force"))
    assert result.code == 2 and "train.max_steps=3" in result.err and "step 4" in result.err


def _config(model: Path, data: Path, run: Path, *extra: str):
    return load_config(None, args(model, data, run, *extra)[1:])


def test_raised_max_steps_continues_the_schedule_and_resumes_bit_exact(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped at step 4 of 8, continued to 12: the LR goes on from where it was, down to the
    floor, and the continued run itself resumes bit-exact after an interruption."""
    quiet = lambda _: None  # noqa: E731
    first = tmp_path / "first"
    # After the backward of micro-batch 3 (step 4's only one): step 4 completes, then the run
    # stops at the next micro-batch boundary with a checkpoint of step 4.
    monkeypatch.setenv(SIGNAL_ENV, "3:TERM")
    with pytest.raises(Interrupted):
        train(_config(tiny_llama_dir, chat_file, first, "train.max_steps=8"), log=quiet)
    monkeypatch.delenv(SIGNAL_ENV)
    assert [m["step"] for m in read_metrics(first / "metrics.jsonl")] == [1, 2, 3, 4]
    c, d = tmp_path / "c", tmp_path / "d"
    shutil.copytree(first, c)
    shutil.copytree(first, d)
    longer = ("train.max_steps=12", "run.resume=force")
    train(_config(tiny_llama_dir, chat_file, c, *longer), log=quiet)
    lrs = [m["lr"] for m in read_metrics(c / "metrics.jsonl")]
    old = [1e-2 * warm_floor(8, s) for s in range(8)]
    assert lrs[:4] == pytest.approx(old[:4])
    assert lrs[4] == pytest.approx(old[4])  # no jump at the resume step
    assert all(a > b for a, b in itertools.pairwise(lrs[4:]))  # then only down
    start, floor = old[4], 1e-3
    expected = [floor + (start - floor) * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert lrs[4:] == pytest.approx(expected)
    # The same continuation, interrupted after step 9 and resumed with the plain command.
    monkeypatch.setenv(SIGNAL_ENV, "8:INT")
    with pytest.raises(Interrupted):
        train(_config(tiny_llama_dir, chat_file, d, *longer), log=quiet)
    monkeypatch.delenv(SIGNAL_ENV)
    train(_config(tiny_llama_dir, chat_file, d, "train.max_steps=12"), log=quiet)
    rc, rd = read_metrics(c / "metrics.jsonl"), read_metrics(d / "metrics.jsonl")
    for key in ("step", "loss", "lr", "grad_norm"):
        assert [m[key] for m in rc] == [m[key] for m in rd], key
    wc = load_file(c / "final" / "adapter_model.safetensors")
    wd = load_file(d / "final" / "adapter_model.safetensors")
    assert all(torch.equal(wc[k], wd[k]) for k in wc)


def test_resume_never_moves_the_old_run_aside_and_never_mixes_them(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)  # 4 steps, checkpoints 2 and 4
    old_final = snapshot(run / "final")
    short = ["train.max_steps=2", "run.resume=never"]
    result = run_cli(args(tiny_llama_dir, chat_file, run, *short))
    assert result.code == 0, result.err
    (aside,) = tmp_path.glob("run.old-*")
    assert str(aside) in result.out
    assert (aside / "checkpoints" / "step-000004").is_dir()
    assert snapshot(aside / "final") == old_final
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    new_final = snapshot(run / "final")
    # The next default start finds only the new run.
    again = run_cli(args(tiny_llama_dir, chat_file, run, "train.max_steps=2"))
    assert again.code == 0, again.err
    assert "step 2" in again.out and "step 4" not in again.out
    assert snapshot(run / "final") == new_final


def test_a_finished_run_whose_checkpoints_were_deleted_is_never_overwritten(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """The run record alone says whose directory it is: with checkpoints/ deleted to free
    space, another config is refused naming the changes, and the same config does not train
    again over final/; run.resume=never moves the finished run aside, whole."""
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    other = run_cli(args(tiny_llama_dir, chat_file, run, "train.lr=5e-3"))
    assert other.code == 2, other
    assert "train.lr: 0.01 -> 0.005" in other.err
    assert "run.dir" in other.err and "run.resume=never" in other.err
    assert snapshot(run) == before
    same = run_cli(args(tiny_llama_dir, chat_file, run))
    assert same.code == 2, same
    assert str(run / "final") in same.err and "run.resume=never" in same.err
    assert snapshot(run) == before
    never = run_cli(args(tiny_llama_dir, chat_file, run, "train.lr=5e-3", "run.resume=never"))
    assert never.code == 0, never.err
    (aside,) = tmp_path.glob("run.old-*")
    assert snapshot(aside) == before


def test_a_run_written_without_a_fingerprint_needs_force(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    _base_run(tiny_llama_dir, chat_file, run)
    (run / "leantune_run.json").unlink()  # as an older leantune left it
    result = run_cli(args(tiny_llama_dir, chat_file, run))
    assert result.code == 2, result
    assert "older leantune" in result.err and "run.resume=force" in result.err
    (run / "leantune_run.json").write_text("{truncated")
    result = run_cli(args(tiny_llama_dir, chat_file, run))
    assert result.code == 2 and "leantune_run.json that cannot be read" in result.err, result
    forced = run_cli(args(tiny_llama_dir, chat_file, run, "run.resume=force"))
    assert forced.code == 0, forced.err
    assert "settings were not recorded" in forced.out
    assert json.loads((run / "leantune_run.json").read_text())["fingerprint"]["train.lr"] == 1e-2
    again = run_cli(args(tiny_llama_dir, chat_file, run))
    assert again.code == 0 and "resumed from" in again.out, again


# ---------------------------------------------------------------------------------------------
# The fingerprint and the schedule continuation, as units


def _settings(*overrides: str) -> dict:
    """The config-only fingerprint of the built-in demo config with `overrides`."""
    return trajectory_settings(load_config(None, list(overrides)))


@pytest.mark.parametrize("mode", ["auto", "force"])
def test_without_a_checkpoint_the_run_record_alone_decides(mode: str, tmp_path: Path) -> None:
    """No checkpoint is no licence: a record of other settings, or one that cannot be read,
    is refused with either mode (force has nothing to continue), and so is a finished run of
    the same settings; only never (which has moved the run aside) and a record of the same
    settings without final/ start afresh."""
    recorded = _settings()
    record = RunRecord(recorded, {}, (1, 8))

    def plan(record: RunRecord | None, fields: dict, mode: str = mode) -> ResumePlan:
        new = Fingerprint(fields, {})
        return plan_resume(mode, tmp_path, None, record, new, (1, 8), print)

    with pytest.raises(RunMismatch) as other:
        plan(record, _settings("train.lr=1e-3", "train.seed=1"))
    assert "train.lr: 0.002 -> 0.001" in str(other.value)
    assert "train.seed: 42 -> 1" in str(other.value)
    assert "run.dir" in str(other.value) and "run.resume=never" in str(other.value)
    assert plan(record, recorded).action == "fresh"  # started, killed before a checkpoint
    (tmp_path / "final").mkdir()
    with pytest.raises(RunMismatch) as finished:
        plan(record, recorded)
    assert str(tmp_path / "final") in str(finished.value)
    assert "run.resume=never" in str(finished.value)
    (tmp_path / "leantune_run.json").write_text("{truncated")
    with pytest.raises(RunMismatch) as unreadable:
        plan(None, recorded)
    assert "cannot be read" in str(unreadable.value)
    assert plan(None, recorded, "never").action == "fresh"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.dtype=bf16", "model.dtype"),
        ("model.attn_implementation=eager", "model.attn_implementation"),
        ("model.rope_scaling={type: linear, factor: 2}", "model.rope_scaling"),
        ("data.format=alpaca", "data.format"),
        ("data.max_seq_len=256", "data.max_seq_len"),
        ("data.pack=false", "data.pack"),
        ("data.system_prompt=Be brief.", "data.system_prompt"),
        ("data.clean=[html]", "data.clean"),
        ("data.dedup=exact", "data.dedup"),
        ("data.near_dup_threshold=0.9", "data.near_dup_threshold"),
        ("data.min_tokens=2", "data.min_tokens"),
        ("data.truncate=true", "data.truncate"),
        ("method.name=dora", "method.name"),
        ("method.r=8", "method.r"),
        ("method.alpha=8", "method.alpha"),
        ("method.target_modules=[q_proj]", "method.target_modules"),
        ("train.lr=1e-3", "train.lr"),
        ("train.optimizer=adamw_8bit", "train.optimizer"),
        ("train.weight_decay=0", "train.weight_decay"),
        ("train.warmup_ratio=0.2", "train.warmup_ratio"),
        ("train.min_lr_ratio=0", "train.min_lr_ratio"),
        ("train.max_grad_norm=0.5", "train.max_grad_norm"),
        ("train.max_steps=10", "train.max_steps"),
        ("train.kl_coef=0.1", "train.kl_coef"),
        ("train.precision=bf16", "train.precision"),
        ("train.seed=1", "train.seed"),
        ("train.grad_accum=2", "train.global_batch"),
    ],
)
def test_each_trajectory_setting_is_in_the_fingerprint(override: str, key: str) -> None:
    base, changed = _settings(), _settings(override)
    assert [c.key for c in compare(base, changed)] == [key]


def test_settings_outside_the_trajectory_leave_the_fingerprint_alone() -> None:
    free = [
        "run.name=other",
        "run.dir=/tmp/elsewhere",
        "run.resume=force",
        "run.progress=false",
        "data.eval=null",
        "data.cache_dir=/tmp/cache",
        "data.max_bad_fraction=0.5",
        "data.partition_mb=8",
        "train.save_every=7",
        "train.keep_last=5",
        "train.eval_exact_match=false",
        "train.eval_limit=3",
        "train.eval_batch_size=2",
        "train.max_new_tokens=9",
        "train.device=cpu",
        "train.memory_budget=1GiB",
        "train.gradient_checkpointing=true",
        "train.compile=true",
        "guard.nonfinite=pause",
        "guard.warmup=5",
        "model.trust_remote_code=true",
        # the demo config's own lr, spelled out again
        "train.lr=2e-3",
    ]
    assert compare(_settings(), _settings(*free)) == []
    assert _settings("train.micro_batch_size=2", "train.grad_accum=2") == _settings(
        "train.micro_batch_size=4"
    )
    auto = _settings("train.micro_batch_size=auto", "train.global_batch_size=4")
    assert auto == _settings("train.micro_batch_size=4")


def test_an_unset_lr_is_the_methods_default() -> None:
    from leantune.methods.registry import DEFAULT_LR

    assert _settings("train.lr=null", "method.name=ia3")["train.lr"] == DEFAULT_LR["ia3"]
    assert compare(_settings("train.lr=null"), _settings(f"train.lr={DEFAULT_LR['lora']}")) == []


def test_large_files_are_hashed_once_until_they_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from leantune.core import digests

    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(digests, "HASH_CACHE_MIN_BYTES", 4)
    monkeypatch.setattr(digests, "RECENT_SECONDS", 0.0)  # files written a moment ago
    hashed: list[Path] = []
    real = digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda p: hashed.append(p) or real(p))
    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"0123456789")
    (weights.parent / "c.json").write_text("{}")  # below the threshold: always hashed
    first = digests.model_digest(weights.parent)
    assert digests.model_digest(weights.parent) == first
    assert [p.name for p in hashed] == ["c.json", "model.safetensors", "c.json"]
    assert len(list((tmp_path / "home" / "hashes").iterdir())) == 1
    weights.write_bytes(b"0123456780")  # same size, new mtime
    os.utime(weights, ns=(1, 1))
    assert digests.model_digest(weights.parent) != first
    assert [p.name for p in hashed[3:]] == ["c.json", "model.safetensors"]


def test_a_prepared_directory_is_identified_by_its_cache_key(tmp_path: Path) -> None:
    from leantune.training.run.fingerprint import data_digest

    prepared = tmp_path / "prep"
    prepared.mkdir()
    (prepared / "prepare_report.json").write_text(json.dumps({"cache_key": "abc123"}))
    assert data_digest(prepared) == "prepared:abc123"
    file = write_jsonl(tmp_path / "a.jsonl", chat_rows(2))
    assert data_digest(file).startswith("sha256:") and len(data_digest(file)) == 71


def test_a_continued_schedule_goes_on_from_where_it_was_down_to_the_floor() -> None:
    from leantune.core.optim import Schedule, default_schedule, warmup_cosine

    old = default_schedule(100, 0.1, 0.1)
    assert [old.multiplier(s) for s in range(100)] == [
        warmup_cosine(s, 100, 10, 0.1) for s in range(100)
    ]
    at = 40
    longer = old.continued(at, old.multiplier(at), 300, 0.05)
    assert longer.multiplier(at) == old.multiplier(at)  # no jump
    series = [longer.multiplier(s) for s in range(at, 301)]
    assert all(a > b for a, b in itertools.pairwise(series))
    assert series[-1] == pytest.approx(0.05)
    assert Schedule.from_json(json.loads(json.dumps(longer.to_json()))) == longer
    # Still in warmup: the ramp goes on unchanged, then the cosine covers the new length.
    early = old.continued(5, old.multiplier(5), 200, 0.1)
    assert [early.multiplier(s) for s in range(5, 10)] == [old.multiplier(s) for s in range(5, 10)]
    assert early.multiplier(10) == 1.0 and early.multiplier(200) == pytest.approx(0.1)
    # A continuation of a continuation is continuous too.
    again = longer.continued(200, longer.multiplier(200), 250, 0.0)
    assert again.multiplier(200) == longer.multiplier(200) and again.multiplier(250) == 0.0


def test_a_record_from_before_data_system_message_reads_as_what_it_ran() -> None:
    """Runs recorded before the field rendered system messages as given (auto, wherever the
    template writes them): they resume under the default, and another value is a change."""
    old = {"data.format": "chat"}
    assert compare(old, {"data.format": "chat", "data.system_message": "auto"}) == []
    [change] = compare(old, {"data.format": "chat", "data.system_message": "fold"})
    assert (change.key, change.old, change.new) == ("data.system_message", "auto", "fold")
