"""The training loop on tiny models: arithmetic, schedule, methods, artefacts, exact resume."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import make_config, prepare_rows
from transformers import AutoModelForCausalLM

from leantune.core.optim import build_optimizer, warmup_cosine
from leantune.data.loader import BatchSchedule, collate
from leantune.methods.artifacts import load_for_inference
from leantune.methods.registry import apply_method, count_parameters
from leantune.models.loading import enable_gradient_checkpointing
from leantune.models.loss import count_supervised
from leantune.monitor.metrics import read_metrics
from leantune.testing.faults import KILL_ENV as FAULT_ENV
from leantune.training.checks import load_config
from leantune.training.recipe import train
from leantune.training.trainer import backward_window

SRC = Path(__file__).resolve().parents[3] / "src"


def test_scheduler_warmup_then_cosine_to_floor() -> None:
    lrs = [warmup_cosine(s, 100, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert warmup_cosine(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert lrs[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_weight_decay_skips_biases_and_norms(tiny_qwen2_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    params = dict(model.named_parameters())
    opt = build_optimizer(params, lr=1e-3, weight_decay=0.1)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in params.items():
        should = p.ndim >= 2 and "norm" not in name
        assert (id(p) in decayed) == should, name


@pytest.mark.parametrize("method", ["full", "lora"])
def test_accumulation_equals_a_larger_batch(
    method: str, tokenizer, tiny_llama_dir: Path, chat_files: tuple[Path, Path]
) -> None:
    data = prepare_rows(chat_files[0], "chat", tokenizer, 128, pack=False)
    cfg = load_config(None, [f"method.name={method}", "method.dropout=0.0"])
    grads = []
    for mbs, accum in ((8, 1), (4, 2), (2, 4)):
        torch.manual_seed(0)
        model = apply_method(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), cfg.method)
        schedule = BatchSchedule(len(data.rows), mbs, seed=1)
        batches = [collate([data.rows[i] for i in schedule.indices(k)], 0) for k in range(accum)]
        if accum > 1:  # unequal supervised counts: a per-micro-batch mean would not match
            assert len({count_supervised(b["labels"]) for b in batches}) > 1
        loss = backward_window(model, batches, torch.device("cpu"), "fp32")
        grads.append(
            (loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        )
    ref_loss, ref = grads[0]
    for loss, g in grads[1:]:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name in ref:
            torch.testing.assert_close(g[name], ref[name], rtol=1e-4, atol=1e-6)


def test_lora_run_trains_only_adapters_and_leaves_a_complete_run(
    tiny_llama_dir: Path, chat_files: tuple[Path, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir,
        chat_files[0],
        run_dir,
        f"data.eval={chat_files[1]}",
        "train.eval_exact_match=true",
        "train.save_every=2",
        "train.max_new_tokens=16",
    )
    logs: list[str] = []
    summary = train(cfg, log=logs.append)
    assert any("parameters train" in line for line in logs)
    # What LoRA adapts, said once in the log and kept in summary.json.
    adapts = [line for line in logs if line.startswith("method lora adapts: ")]
    assert len(adapts) == 1 and adapts[0].startswith(
        "method lora adapts: attention q_proj, k_proj, v_proj, o_proj x 2 layers"
    )
    adapted = json.loads((run_dir / "summary.json").read_text())["adapted"]
    assert [(g["kind"], g["names"]) for g in adapted["groups"]] == [
        ("attention", ["q_proj", "k_proj", "v_proj", "o_proj"]),
        ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    ]
    assert sum(g["params"] for g in adapted["groups"]) == summary["trainable_params"]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".leantune.lock",  # held while a process trains in this directory
        "checkpoints",
        "config.yaml",
        "eval_predictions.jsonl",
        "final",
        "leantune_run.json",  # the run's fingerprint: what a resume must match
        "memory_plan.json",  # the planner's predicted peak, drawn against the measured memory
        "metrics.jsonl",
        "prepared",  # the tokenise-once cache of data.train / data.eval
        "report.html",  # monitor.report: charts, events, data report (rebuilt by `leantune report`)
        "summary.json",
    ]
    preds = [json.loads(x) for x in (run_dir / "eval_predictions.jsonl").read_text().splitlines()]
    assert [p["line"] for p in preds] == [1, 2, 3, 4]
    assert sum(p["match"] for p in preds) / 4 == summary["eval_exact_match"]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes"):
        assert all(isinstance(m[key], (int, float)) for m in metrics), key
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert summary["steps"] == 4 and 0 <= summary["eval_exact_match"] <= 1
    assert summary["base_exact_match"] is not None and summary["eval_loss"] > 0
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000004"]
    # Only adapter weights are in the checkpoint, and the base weights did not move.
    weights = load_file(run_dir / "checkpoints" / "step-000004" / "model.safetensors")
    assert weights and all("lora_" in k for k in weights)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tuned, _ = load_for_inference(str(run_dir / "final"))
    tuned_base = dict(tuned.get_base_model().named_parameters())  # type: ignore[union-attr]
    for name, p in base.named_parameters():
        key = name.replace(".weight", ".base_layer.weight")
        other = tuned_base.get(name, tuned_base.get(key))
        assert other is not None and torch.equal(p, other), name
    assert any(not torch.all(w == 0) for k, w in weights.items() if "lora_B" in k)
    trainable, total = count_parameters(tuned)
    # all-linear r=16 on 2 layers: q,k,v,o (64->64/32) and gate/up/down (64<->128)
    assert (run_dir / "final" / "adapter_config.json").is_file()
    assert (run_dir / "final" / "leantune_base.json").is_file()
    assert total > 0 and trainable == 0  # inference load is frozen


def test_full_run_saves_a_plain_hf_model(
    tiny_qwen2_dir: Path, chat_files: tuple[Path, Path], tmp_path: Path
) -> None:
    cfg = make_config(
        tiny_qwen2_dir,
        chat_files[0],
        tmp_path / "run",
        "method.name=full",
        "train.lr=1e-3",
        "train.max_steps=2",
    )
    train(cfg, log=lambda _: None)
    final = tmp_path / "run" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    changed = [
        n
        for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters(), strict=True)
        if not torch.equal(p, q)
    ]
    assert len(changed) == len(list(base.parameters()))


def _run_cli(
    args: list[str], env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), **(env_extra or {})}
    env.pop(FAULT_ENV, None) if not env_extra else None
    return subprocess.run(
        [sys.executable, "-m", "leantune", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_resume_after_sigkill_is_bit_exact(
    tiny_llama_dir: Path, chat_files: tuple[Path, Path], tmp_path: Path
) -> None:
    common = [
        f"model.path={tiny_llama_dir}",
        f"data.train={chat_files[0]}",
        "data.format=chat",
        "data.max_seq_len=128",
        "run.progress=false",
        "train.max_steps=6",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.save_every=2",
        "train.lr=1e-2",
        "method.dropout=0.1",
        "train.precision=fp32",
        "data.eval=null",
        "train.eval_exact_match=false",
    ]
    straight = _run_cli([*common, f"run.dir={tmp_path / 'a'}"])
    assert straight.returncode == 0, straight.stderr
    # Killed after micro-batch 8, inside the window of step 5 (micro-batches 8 and 9).
    killed = _run_cli([*common, f"run.dir={tmp_path / 'b'}"], {FAULT_ENV: "8"})
    assert killed.returncode == -9, killed.stderr
    ckpts = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000004"]
    assert not (tmp_path / "b" / "final").exists()
    resumed = _run_cli([*common, f"run.dir={tmp_path / 'b'}"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step 4" in resumed.stdout
    a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    assert [m["grad_norm"] for m in a] == [m["grad_norm"] for m in b]
    assert [m["lr"] for m in a] == [m["lr"] for m in b]
    wa = load_file(tmp_path / "a" / "final" / "adapter_model.safetensors")
    wb = load_file(tmp_path / "b" / "final" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_never_starts_over(tiny_llama_dir: Path, chat_files, tmp_path: Path) -> None:
    cfg = make_config(tiny_llama_dir, chat_files[0], tmp_path / "run", "train.max_steps=2")
    train(cfg, log=lambda _: None)
    logs: list[str] = []
    cfg = make_config(
        tiny_llama_dir, chat_files[0], tmp_path / "run", "train.max_steps=2", "run.resume=never"
    )
    train(cfg, log=logs.append)
    assert not any("resumed" in line for line in logs)
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    (aside,) = tmp_path.glob("run.old-*")  # the first run, moved aside, not mixed in
    assert any(str(aside) in line for line in logs)
    assert [m["step"] for m in read_metrics(aside / "metrics.jsonl")] == [1, 2]


def test_gradient_checkpointing_gives_the_same_gradients(tokenizer, tiny_llama_dir, chat_files):
    data = prepare_rows(chat_files[0], "chat", tokenizer, 128, pack=True)
    cfg = load_config(None, ["method.name=lora"])
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = apply_method(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), cfg.method)
        if checkpointing:
            enable_gradient_checkpointing(model)
            assert model.get_base_model().is_activation_checkpointing
        model.train()
        backward_window(model, [collate(data.rows[:2], 0)], torch.device("cpu"), "fp32")
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7)


def test_merge_for_inference_keeps_logits(tiny_qwen2_dir: Path) -> None:
    from leantune.methods.registry import merge_for_inference

    cfg = load_config(None, ["method.name=lora"])
    torch.manual_seed(0)
    model = apply_method(AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir), cfg.method).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.arange(1, 20)[None]
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        merge_for_inference(model)
        after = model(input_ids=ids).logits
        base = plain(input_ids=ids).logits
    assert (before - base).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_frozen_weights_in_bf16_with_fp32_adapters(
    tiny_llama_dir: Path, chat_files: tuple[Path, Path], tmp_path: Path
) -> None:
    from leantune.models.loading import ModelSource, load_model

    cfg = load_config(None, ["method.name=lora"])
    model = apply_method(load_model(ModelSource(str(tiny_llama_dir)), dtype="bf16"), cfg.method)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if "lora_" not in n)
    run = make_config(tiny_llama_dir, chat_files[0], tmp_path / "run", "model.dtype=bf16")
    summary = train(run, log=lambda _: None)
    losses = [m["loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert summary["steps"] == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_kl_regularised_run_completes(tiny_llama_dir: Path, chat_files, tmp_path: Path) -> None:
    cfg = make_config(tiny_llama_dir, chat_files[0], tmp_path / "kl", "train.kl_coef=0.2")
    assert train(cfg, log=lambda _: None)["steps"] == 4
    losses = [m["loss"] for m in read_metrics(tmp_path / "kl" / "metrics.jsonl")]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
