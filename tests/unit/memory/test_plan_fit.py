"""The planner's verdicts at the sizes people bring: "fits" only with the measured
margin, the load phase as its own line, a fixed micro-batch that cannot fit said before the
model loads, and half-precision weights offered before a lighter method."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from support import plan_config_file, tiny_llama_config
from transformers import LlamaForCausalLM, Qwen2Config

import leantune.memory.budget as memory_budget
from leantune.bench.model_shapes import config_kwargs
from leantune.cli.app import main
from leantune.config import MethodConfig
from leantune.core.allocator import train_allocator
from leantune.errors import UserError
from leantune.memory.estimate import FIT_MARGIN, GIB, RUNTIME_OVERHEAD, StepSettings, estimate
from leantune.memory.inputs import model_facts_for, plan_basis
from leantune.memory.planner import WeightOption, recommend
from leantune.memory.resolve import plan_for_run
from leantune.training.checks import load_config
from leantune.training.planning import plan_inputs


def _config_file(tmp_path: Path, model_dir: Path, train: str) -> Path:
    return plan_config_file(tmp_path, model_dir, train)


@pytest.mark.parametrize(
    ("allocator", "measured"), [("glibc", 1.65), ("tcmalloc", 1.13), ("jemalloc", 1.65)]
)
def test_fits_only_with_the_margin(allocator: str, measured: float) -> None:
    """A plan whose live tensors just fit the budget does not fit: CPU RSS ran 1.08x-1.65x above
    them with glibc's malloc, 1.05x-1.13x with tcmalloc
    (benchmarks/results/scale-cpu.json); 21.67 GiB 'fitting' 22 GiB got a run killed at 23.9 GB.
    An allocator nobody measured gets glibc's margin."""
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="full"))
    step = StepSettings(micro_batch=4, seq_len=64, allocator=allocator)
    b = estimate(facts, step)
    assert measured <= b.margin <= 1.7
    assert b.margin == FIT_MARGIN.get(allocator, FIT_MARGIN["glibc"])
    assert b.needed == max(int(b.peak * b.margin + 0.5), b.load)
    # The live tensors fit exactly: not enough for these settings.
    plan = recommend({"full": facts}, "full", step, 4, b.peak)
    assert plan is None or (plan.micro_batch, plan.gradient_checkpointing) != (4, False)
    assert plan is None or plan.breakdown.needed <= b.peak
    plan = recommend({"full": facts}, "full", step, 4, b.needed)
    assert plan is not None and plan.micro_batch == 4 and not plan.gradient_checkpointing
    plan = recommend({"full": facts}, "full", step, 4, b.needed - 1)
    assert plan is None or plan.micro_batch < 4 or plan.gradient_checkpointing


def test_a_4bit_base_on_cuda_has_its_own_margin() -> None:
    """On an H200 the reserved peak ran 1.02x-1.04x the plan for full and LoRA but 1.29x-1.54x
    with a 4-bit base (benchmarks/results/scale-cuda.json): CUDA's margin covers each."""
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="lora"))
    plain = estimate(facts, StepSettings(2, 64, device="cuda", allocator="tcmalloc"))
    quantised = estimate(facts, StepSettings(2, 64, device="cuda", weight_quant="nf4"))
    assert 1.04 <= plain.margin == FIT_MARGIN["cuda"] < quantised.margin
    assert quantised.margin == FIT_MARGIN["cuda-4bit"] >= 1.54
    assert quantised.needed == int(quantised.peak * quantised.margin + 0.5)


def test_the_load_phase_is_its_own_line() -> None:
    """Loading maps the checkpoint's file pages (counted in RSS) while the weights are built at
    the run's dtype: a bf16 file loaded as fp32 holds both (measured on a 0.3 GB Qwen2: file
    pages and the fp32 copy coexisted); loaded at its own dtype the weights are those pages."""
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="lora"))
    file_bytes = facts.total_params * 2
    over = RUNTIME_OVERHEAD["cpu"]
    converted = StepSettings(2, 64, checkpoint_bytes=file_bytes, checkpoint_itemsize=2)
    assert estimate(facts, converted).load == over + facts.weight_bytes + file_bytes
    same = replace(converted, checkpoint_bytes=facts.weight_bytes, checkpoint_itemsize=4)
    assert estimate(facts, same).load == over + facts.weight_bytes
    quantised = replace(converted, weight_quant="nf4")
    b = estimate(facts, quantised)
    assert b.load == over + b.weights + file_bytes
    # Read tensor by tensor (models/weight_files.py): the weights and one tensor in flight.
    streamed = replace(converted, checkpoint_streamed=True)
    b = estimate(facts, streamed)
    assert b.load == over + facts.weight_bytes + facts.largest_tensor * (4 + 2)
    real = LlamaForCausalLM(tiny_llama_config())
    assert facts.largest_tensor == max(p.numel() for p in real.parameters())
    # On a GPU the checkpoint is read into host memory, not into the budgeted device memory.
    assert estimate(facts, replace(converted, device="cuda")).load == 0
    assert estimate(facts, StepSettings(2, 64)).load == 0  # no checkpoint known: not modelled


def test_plan_reads_the_checkpoint_and_shows_the_load_line(
    tmp_path: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _config_file(tmp_path, tiny_llama_dir, "{micro_batch_size: 4, grad_accum: 2}")
    files = sum(f.stat().st_size for f in tiny_llama_dir.glob("*.safetensors"))
    assert files > 0
    assert main(["plan", str(cfg), "--budget", "64GiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    b = result["configured"]["breakdown"]
    # Its safetensors are read tensor by tensor: the weights and one tensor, never the files too.
    assert b["overhead"] + b["weights"] < b["load"] < b["overhead"] + b["weights"] + files
    assert result["allocator"] == train_allocator()
    assert b["margin"] == FIT_MARGIN[result["allocator"]]
    # Between the live peak and the peak with the margin: does not fit.
    between = (b["peak"] + b["needed"]) // 2
    assert main(["plan", str(cfg), "--budget", str(between), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main(["plan", str(cfg), "--budget", "64GiB"]) == 0
    text = capsys.readouterr().out
    assert "loading the checkpoint" in text and f"x{b['margin']:g}" in text


@pytest.mark.parametrize(("setting", "allocator"), [("system", "glibc"), ("auto", None)])
def test_plan_sizes_the_margin_by_the_allocator_train_will_have(
    tmp_path: Path,
    tiny_llama_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    allocator: str | None,
) -> None:
    """`leantune plan` runs without the preload `train` gets: it sizes the margin by the
    allocator train will run with (LEANTUNE_ALLOCATOR=system: glibc's; auto: tcmalloc where
    installed), and says which."""
    monkeypatch.setenv("LEANTUNE_ALLOCATOR", setting)
    cfg = _config_file(tmp_path, tiny_llama_dir, "{micro_batch_size: 4, grad_accum: 2}")
    assert main(["plan", str(cfg), "--budget", "64GiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = allocator or train_allocator()
    assert result["allocator"] == expected
    assert result["configured"]["breakdown"]["margin"] == FIT_MARGIN[expected]
    assert main(["plan", str(cfg), "--budget", "64GiB"]) == 0
    assert f"{'tcmalloc' if expected == 'tcmalloc' else 'glibc'}" in capsys.readouterr().out


LEVERS = ("micro_batch_size", "gradient_checkpointing", "method.name", "model.dtype")


def test_a_fixed_micro_batch_that_cannot_fit_is_refused_before_loading(
    tmp_path: Path, tiny_llama_dir: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU, micro_batch_size 4 as configured, no train.memory_budget: a prediction above the
    available memory is refused (exit 2) before the model loads, one within the available
    memory but not its margin is a warning; both name the levers."""
    import leantune.training.build as build
    import leantune.training.recipe as recipe

    cfg = load_config(
        _config_file(tmp_path, tiny_llama_dir, "{micro_batch_size: 4, grad_accum: 2}"),
        [f"run.dir={tmp_path / 'run'}", "run.progress=false", "train.max_steps=1"],
    )
    inputs = plan_basis(plan_inputs(cfg), "cpu", 64, 64)
    live = estimate(inputs.facts, inputs.step).peak
    loads: list[object] = []
    monkeypatch.setattr(build, "load_model", lambda *a, **k: loads.append(a))
    # Less than the runtime alone (whatever the rows' lengths): certainly cannot fit.
    monkeypatch.setattr(
        memory_budget, "available_memory", lambda device: RUNTIME_OVERHEAD["cpu"] // 2
    )
    with pytest.raises(UserError) as refused:
        recipe.train(cfg, log=lambda _: None)
    message = str(refused.value)
    assert loads == [] and all(lever in message for lever in LEVERS), message
    assert "train.memory_budget" in message
    # Room for the live tensors but not for the margin: a warning, and the run goes on.
    monkeypatch.setattr(memory_budget, "available_memory", lambda device: int(live * 1.2))
    labels = [[1] * 64] * 8
    t, memory = plan_for_run(plan_inputs(cfg), "cpu", labels)
    assert t.micro_batch_size == 4
    assert memory.note.startswith("warning:") and all(x in memory.note for x in LEVERS)
    assert "train.memory_budget" in memory.note
    # Plenty of memory: no warning.
    monkeypatch.setattr(memory_budget, "available_memory", lambda device: 64 * GIB)
    assert not plan_for_run(plan_inputs(cfg), "cpu", labels)[1].note.startswith("warning:")


def test_lora_on_a_7b_is_offered_bf16_weights_before_qlora() -> None:
    """LoRA with fp32 weights on a 7B does not fit 28 GiB, but with model.dtype=bf16 and
    checkpointing it does: that comes before jumping to QLoRA (config shapes only, no weights)."""
    config = Qwen2Config(**config_kwargs("7b"))  # Qwen2.5-7B's published shape
    lora = MethodConfig(name="lora")
    fp32 = model_facts_for(config, "fp32", "sdpa", lora)
    bf16 = model_facts_for(config, "bf16", "sdpa", lora)
    qlora = model_facts_for(config, "bf16", "sdpa", MethodConfig(name="qlora"))
    step = StepSettings(micro_batch=2, seq_len=512, supervised_per_row=256)
    budget = 28 * GIB
    ckpt = replace(step, micro_batch=1, gradient_checkpointing=True)
    assert estimate(fp32, ckpt).needed > budget >= estimate(bf16, ckpt).needed
    ladder = {"lora": fp32, "qlora": qlora}
    without = recommend(ladder, "lora", step, 2, budget)
    assert without is not None and without.method == "qlora"  # what it did before
    option = WeightOption("bf16", bf16, step, 2)
    plan = recommend(ladder, "lora", step, 2, budget, lighter_weights=option)
    assert plan is not None
    assert (plan.method, plan.model_dtype, plan.gradient_checkpointing) == ("lora", "bf16", True)
    assert plan.breakdown.needed <= budget
    assert plan.as_dict()["model_dtype"] == "bf16"
