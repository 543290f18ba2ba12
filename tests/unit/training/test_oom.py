"""OOM recovery: halve the micro-batch, keep the global batch, replay the same samples."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support import make_config

from leantune.cli.app import main
from leantune.config import ConfigError, parse_memory_size
from leantune.monitor.events import EXIT_OUT_OF_MEMORY, OutOfMemoryAtMinimum, read_events
from leantune.monitor.metrics import read_metrics
from leantune.monitor.step_stats import TIMING_FIELDS
from leantune.testing.faults import OOM_EVAL_ENV, OOM_STEP_ENV
from leantune.training import recipe, trainer
from leantune.training.checks import load_config
from leantune.training.guard.oom import retry_on_oom
from leantune.training.state.checkpoint import latest_checkpoint, load_checkpoint

VOLATILE = (*TIMING_FIELDS, "micro_batch_size", "grad_accum")


@pytest.fixture()
def seen(monkeypatch: pytest.MonkeyPatch) -> list[list[list[int]]]:
    """The micro-batches (rows as token lists, padding stripped) of every completed window."""
    windows: list[list[list[int]]] = []
    original = trainer.backward_window

    def spy(model: Any, batches: list[dict[str, torch.Tensor]], *args: Any, **kw: Any) -> float:
        loss = original(model, batches, *args, **kw)
        windows.append(
            [
                [
                    real_tokens(ids, pos)
                    for ids, pos in zip(b["input_ids"], b["position_ids"], strict=True)
                ]
                for b in batches
            ]
        )
        return loss

    monkeypatch.setattr(trainer, "backward_window", spy)
    return windows


def real_tokens(ids: torch.Tensor, pos: torch.Tensor) -> list[int]:
    """One unpacked row without its padding (padding positions restart at 0)."""
    restarts = (pos[1:] == 0).nonzero()
    return ids[: int(restarts[0]) + 1 if len(restarts) else len(ids)].tolist()


def lora_config(
    tiny_llama_dir: Path, train_file: Path, run: Path, mbs: int, accum: int, *extra: str
):
    return make_config(
        tiny_llama_dir, train_file, run, "data.pack=false", "method.dropout=0.0",
        "train.max_steps=6", "train.save_every=2", "train.lr=1e-3",
        f"train.micro_batch_size={mbs}", f"train.grad_accum={accum}",
        # Another split sums the same losses in another order: equal to fp32 rounding (rel 1e-5);
        # bf16 autocast (auto on an AMX CPU) rounds each micro-batch's matmuls, 1.6e-5 apart.
        "train.precision=fp32", *extra,
    )  # fmt: skip


def test_oom_halves_the_micro_batch_and_replays_the_same_samples(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
    monkeypatch,
    seen,
) -> None:
    # Reference: micro-batch 2 x 4 from the start.
    recipe.train(
        lora_config(tiny_llama_dir, chat_files[0], tmp_path / "b", 2, 4), log=lambda _: None
    )
    reference = list(seen)
    seen.clear()
    # Micro-batch 4 x 2; the last micro-batch of step 3 runs out of memory.
    monkeypatch.setenv(OOM_STEP_ENV, "3")
    run = tmp_path / "a"
    recipe.train(lora_config(tiny_llama_dir, chat_files[0], run, 4, 2), log=lambda _: None)
    monkeypatch.delenv(OOM_STEP_ENV)

    assert len(seen) == len(reference) == 6  # the failed attempt never completed a window
    assert [len(w) for w in seen] == [2, 2, 4, 4, 4, 4]
    flat = lambda ws: [row for w in ws for mb in w for row in mb]  # noqa: E731
    assert flat(seen) == flat(reference)  # per-sample order: nothing skipped or repeated
    assert seen[2:] == reference[2:]  # from the OOM on, the very same micro-batches
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert [(m["micro_batch_size"], m["grad_accum"]) for m in metrics] == [(4, 2)] * 2 + [
        (2, 4)
    ] * 4
    ref_metrics = read_metrics(tmp_path / "b" / "metrics.jsonl")
    for m, r in zip(metrics, ref_metrics, strict=True):
        assert m["lr"] == r["lr"] and m["tokens"] == r["tokens"]
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-5)
    events = read_events(run / "events.jsonl")
    assert [(e["kind"], e["step"], e["micro_batch_size"], e["grad_accum"]) for e in events] == [
        ("oom", 3, 2, 4)
    ]
    wa = load_file(run / "final" / "adapter_model.safetensors")
    wb = load_file(tmp_path / "b" / "final" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        # Adam divides each gradient by its running RMS, so an fp32 rounding difference in a
        # near-zero gradient moves that weight by a sizeable fraction of lr (1e-3): with AVX2
        # kernels one of 512 LoRA weights ends 1.6e-7 apart. 1e-6 is 0.1% of one step.
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    # The checkpoint records the smaller micro-batch, and a resume keeps it (bit-exact).
    ckpt = load_checkpoint(run / "checkpoints" / "step-000004")
    assert ckpt.state.extra["batching"] == {
        "global_batch": 8,
        "micro_batch_size": 2,
        "samples_seen": 32,
    }
    shutil.rmtree(run / "checkpoints" / "step-000006")
    shutil.rmtree(run / "final")
    recipe.train(lora_config(tiny_llama_dir, chat_files[0], run, 4, 2), log=lambda _: None)
    resumed = read_metrics(run / "metrics.jsonl")
    assert [(m["step"], m["micro_batch_size"]) for m in resumed[4:]] == [(5, 2), (6, 2)]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in metrics]
    wr = load_file(run / "final" / "adapter_model.safetensors")
    assert all(torch.equal(wr[k], wa[k]) for k in wa)


def test_oom_at_micro_batch_one_stops_naming_the_next_levers(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
    monkeypatch,
    capsys,
) -> None:
    monkeypatch.setenv(OOM_STEP_ENV, "2")
    run = tmp_path / "run"
    args = [
        "train", f"model.path={tiny_llama_dir}", f"data.train={chat_files[0]}", "data.eval=null",
        "data.max_seq_len=128", "train.eval_exact_match=false", "train.micro_batch_size=1",
        "train.max_steps=4", f"run.dir={run}", "run.progress=false",
    ]  # fmt: skip
    assert main(args) == EXIT_OUT_OF_MEMORY
    err = capsys.readouterr().err
    assert "out of memory at step 2 with train.micro_batch_size=1" in err
    for lever in ("train.gradient_checkpointing=true", "data.max_seq_len (now 128)", "qlora"):
        assert lever in err
    # Progress up to the failing step is checkpointed.
    ckpt = load_checkpoint(latest_checkpoint(run / "checkpoints"))  # type: ignore[arg-type]
    assert ckpt.state.step == 1
    assert [e["kind"] for e in read_events(run / "events.jsonl")] == ["oom"]


def test_the_checkpoint_an_oom_at_micro_batch_one_writes_holds_the_last_steps_rng(
    tiny_llama_dir: Path, chat_files, tmp_path: Path, monkeypatch
) -> None:
    """The failed window's forwards drew dropout masks: the checkpoint written on the way out
    must hold the RNG of the last applied step (as a stop signal's does), so a resume with
    more memory draws what an uninterrupted run draws."""
    common = [
        "train", f"model.path={tiny_llama_dir}", f"data.train={chat_files[0]}", "data.eval=null",
        "data.max_seq_len=128", "train.eval_exact_match=false", "train.micro_batch_size=1",
        "train.global_batch_size=4", "method.dropout=0.5", "run.progress=false",
    ]  # fmt: skip
    straight = tmp_path / "straight"
    assert main([*common, "train.max_steps=1", f"run.dir={straight}"]) == 0
    monkeypatch.setenv(OOM_STEP_ENV, "2")  # at step 2's last micro-batch: 3 forwards drew masks
    run = tmp_path / "run"
    assert main([*common, "train.max_steps=4", f"run.dir={run}"]) == EXIT_OUT_OF_MEMORY
    after_oom = load_checkpoint(latest_checkpoint(run / "checkpoints"))  # type: ignore[arg-type]
    step_1 = load_checkpoint(latest_checkpoint(straight / "checkpoints"))  # type: ignore[arg-type]
    assert after_oom.state.step == step_1.state.step == 1
    assert torch.equal(after_oom.rng["torch"], step_1.rng["torch"])


def test_cpu_memory_budget_is_checked_on_every_micro_batch(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
) -> None:
    # A budget below what the interpreter alone holds: every size fails, 4 -> 2 -> 1 -> stop.
    run = tmp_path / "run"
    cfg = lora_config(tiny_llama_dir, chat_files[0], run, 4, 1, "train.memory_budget=1MiB")
    with pytest.raises(OutOfMemoryAtMinimum, match=r"train\.micro_batch_size=1"):
        recipe.train(cfg, log=lambda _: None)
    events = read_events(run / "events.jsonl")
    assert [(e["kind"], e.get("micro_batch_size")) for e in events] == [
        ("oom", 2), ("oom", 1), ("oom", None)
    ]  # fmt: skip
    assert "above train.memory_budget=0.00 GiB" in events[0]["message"]
    # A generous budget changes nothing.
    roomy = lora_config(
        tiny_llama_dir, chat_files[0], tmp_path / "r", 4, 1, "train.memory_budget=1TiB"
    )
    assert recipe.train(roomy, log=lambda _: None)["steps"] == 6
    assert not (tmp_path / "r" / "events.jsonl").exists()


def test_eval_oom_shrinks_only_the_eval_batch(
    tiny_llama_dir: Path,
    chat_files,
    tmp_path: Path,
    monkeypatch,
) -> None:
    def run(name: str) -> dict[str, Any]:
        cfg = lora_config(
            tiny_llama_dir, chat_files[0], tmp_path / name, 4, 1,
            f"data.eval={chat_files[1]}", "train.eval_batch_size=4", "train.max_steps=2",
        )  # fmt: skip
        return recipe.train(cfg, log=lambda _: None)

    plain = run("plain")
    monkeypatch.setenv(OOM_EVAL_ENV, "2")
    squeezed = run("oom")
    assert squeezed["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    events = read_events(tmp_path / "oom" / "events.jsonl")
    assert [(e["kind"], e["step"], e["eval_batch_size"]) for e in events] == [
        ("oom_eval", 2, 2), ("oom_eval", 2, 1)
    ]  # fmt: skip
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIMING_FIELDS} for m in ms]  # noqa: E731
    assert strip(read_metrics(tmp_path / "oom" / "metrics.jsonl")) == strip(
        read_metrics(tmp_path / "plain" / "metrics.jsonl")
    )
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "oom" / "checkpoints"))  # type: ignore[arg-type]
    assert ckpt.state.extra["batching"]["micro_batch_size"] == 4


def test_eval_retry_gives_up_at_batch_one() -> None:
    sizes: list[int] = []

    def always_oom(bs: int) -> float:
        sizes.append(bs)
        raise torch.OutOfMemoryError("no")

    with pytest.raises(torch.OutOfMemoryError):
        retry_on_oom(always_oom, 8, lambda *_: None, torch.device("cpu"))
    assert sizes == [8, 4, 2, 1]
    with pytest.raises(ValueError):  # other errors are not retried
        retry_on_oom(lambda bs: int("x"), 8, lambda *_: None, torch.device("cpu"))


def test_memory_budget_parsing_and_validation() -> None:
    assert parse_memory_size("20GiB") == 20 * 2**30
    assert parse_memory_size("512 MiB") == 512 * 2**20
    assert parse_memory_size("1.5GB") == 1_500_000_000
    with pytest.raises(ConfigError, match=r"train\.memory_budget: '20 gigs' is not a memory size"):
        load_config(None, ["train.memory_budget=20 gigs"])
    assert load_config(None, ["train.memory_budget=8GiB"]).train.memory_budget == "8GiB"
