"""The memory planner: exact parameter arithmetic, activations against autograd's own saved
tensors, monotonicity, recommendations that keep the global batch, `auto`, and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support import plan_config_file, prepare_rows, tiny_llama_config
from transformers import AutoModelForCausalLM

from leantune.cli.app import main
from leantune.config import Config, ConfigError, MethodConfig, configured_global_batch
from leantune.memory.budget import parse_size
from leantune.memory.estimate import GIB, StepSettings, estimate
from leantune.memory.inputs import PlanBasis, max_supervised_per_row, model_facts_for, plan_basis
from leantune.memory.planner import recommend, resolve_micro_batch
from leantune.methods.frozen import store_frozen_linears
from leantune.methods.registry import apply_method, count_parameters
from leantune.models.loss import token_loss_sum
from leantune.training.checks import load_config
from leantune.training.planning import plan_inputs

METHODS = ["full", "lora", "dora", "ia3", "freeze"]


def _basis(cfg: Config, device: str, *rows: int | None) -> PlanBasis:
    """The planner's model facts and step for `cfg` (rows: supervised per row, longest)."""
    return plan_basis(plan_inputs(cfg), device, *rows)


def _real(method: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return apply_method(AutoModelForCausalLM.from_config(tiny_llama_config()), MethodConfig(method))


@pytest.mark.parametrize("method", METHODS)
def test_meta_facts_equal_the_real_model(method: str) -> None:
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name=method))  # type: ignore[arg-type]
    model = _real(method)
    trainable, total = count_parameters(model)
    tensors = list(dict(model.named_parameters()).values()) + [b for _, b in model.named_buffers()]
    assert facts.weight_bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert (facts.trainable_params, facts.total_params) == (trainable, total)
    assert facts.trainable_bytes == 4 * trainable
    b = estimate(facts, StepSettings(2, 32))
    assert b.gradients == 4 * trainable
    assert b.optimizer == 8 * trainable  # fp32 AdamW: two moments


@pytest.mark.parametrize("method", [*METHODS, "qlora", "adapter"])
def test_the_blocks_linear_weights_are_counted_inside_adapter_wrappers(method: str) -> None:
    """peft wraps an adapted linear (`q_proj.base_layer`); QLoRA's 4-bit weights and the
    autocast weight copies are sized from these. They were 0 for lora/qlora/dora, so a QLoRA
    plan kept the base at full size."""
    full = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="full"))
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name=method))  # type: ignore[arg-type]
    assert (
        facts.linear_params == full.linear_params == 2 * (64 * (64 + 32 + 32 + 64) + 3 * 64 * 128)
    )


def test_optimizer_bits_and_nf4_weights() -> None:
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="lora"))
    n = facts.trainable_params
    st = StepSettings(1, 16)
    assert estimate(facts, replace(st, optimizer="adamw_8bit")).optimizer == 2 * n
    assert estimate(facts, replace(st, optimizer="adamw_4bit")).optimizer == n
    dense = facts.weight_bytes - 4 * facts.linear_params
    nf4 = estimate(facts, replace(st, weight_quant="nf4")).weights
    dq = estimate(facts, replace(st, weight_quant="nf4-dq")).weights
    assert nf4 == int(dense + facts.linear_params * (0.5 + 4 / 64))
    assert dq == int(dense + facts.linear_params * (0.5 + 1 / 64 + 4 / 64 / 256))
    with pytest.raises(ValueError, match="unknown optimizer"):
        estimate(facts, replace(st, optimizer="sgd"))


def _saved_activation_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd saves for backward, excluding the model's own parameters and buffers."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}
    held: list[torch.Tensor] = []  # a freed storage's address, reused, must not merge two

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
            held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_loss_sum(model, batch)
    return sum(seen.values())


# DoRA keeps a few tensors beyond the base and adapter outputs the planner counts (-6% here).
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    ("method", "tolerance"),
    [("full", 0.01), ("lora", 0.01), ("dora", 0.08), ("ia3", 0.01), ("freeze", 0.01)],
)
def test_activations_match_what_autograd_saves(
    method: str, tolerance: float, precision: str
) -> None:
    """Per-block prediction vs the real model's saved tensors: the difference between a 4-block
    and a 2-block model isolates two blocks, whatever is outside them. bf16 (autocast, what
    train.precision=auto picks on CPUs with AMX and on GPUs) keeps each linear's own bf16 copy
    of its input and of its weight (a frozen weight is stored in bf16 instead): the planner
    missed both (-18% for full and lora)."""
    seq, mb = 128, 2
    pos = torch.cat([torch.arange(64), torch.arange(64)]).repeat(mb, 1)  # packed: 2 per row
    ids = torch.randint(3, 384, (mb, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}
    saved, predicted = [], []
    for layers in (2, 4):
        config = tiny_llama_config()
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        model = apply_method(AutoModelForCausalLM.from_config(config), MethodConfig(method))  # type: ignore[arg-type]
        model.train()
        if precision == "bf16":  # as training stores them (`training.build.wrap_method`)
            store_frozen_linears(model, torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            saved.append(_saved_activation_bytes(model, batch))
        facts = model_facts_for(config, "fp32", "sdpa", MethodConfig(name=method))  # type: ignore[arg-type]
        predicted.append(estimate(facts, StepSettings(mb, seq, precision=precision)).activations)
    two_blocks_saved, two_blocks_predicted = saved[1] - saved[0], predicted[1] - predicted[0]
    assert two_blocks_predicted == pytest.approx(two_blocks_saved, rel=tolerance)


def test_monotone_in_batch_sequence_and_checkpointing() -> None:
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="lora"))
    base = StepSettings(2, 64)
    a = estimate(facts, base)
    assert estimate(facts, replace(base, micro_batch=4)).activations > a.activations
    assert estimate(facts, replace(base, seq_len=128)).activations > a.activations
    ckpt = estimate(facts, replace(base, gradient_checkpointing=True))
    assert ckpt.activations < a.activations and ckpt.peak < a.peak
    assert ckpt.recompute > 0 and a.recompute == 0
    assert estimate(facts, replace(base, supervised_per_row=8)).loss < a.loss
    eager = estimate(facts, replace(base, attn_implementation="eager"))
    assert eager.activations > a.activations  # eager keeps the attention probabilities


def test_recommend_keeps_the_global_batch_and_follows_the_checklist() -> None:
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="lora"))
    step = StepSettings(8, 256)
    sizes = {mb: estimate(facts, replace(step, micro_batch=mb)).needed for mb in (1, 2, 4, 8)}
    plan = recommend({"lora": facts}, "lora", step, 16, sizes[8])
    assert plan is not None and (plan.micro_batch, plan.grad_accum) == (8, 2)
    plan = recommend({"lora": facts}, "lora", step, 16, sizes[4])  # halve first
    assert plan is not None and (plan.micro_batch, plan.grad_accum) == (4, 4)
    assert not plan.gradient_checkpointing
    ckpt1 = estimate(facts, replace(step, micro_batch=1, gradient_checkpointing=True)).needed
    assert ckpt1 < sizes[1]
    plan = recommend({"lora": facts}, "lora", step, 16, ckpt1)  # then checkpointing
    assert plan is not None and plan.gradient_checkpointing
    assert plan.micro_batch * plan.grad_accum == 16
    assert recommend({"lora": facts}, "lora", step, 16, ckpt1 - 1) is None


def test_resolve_micro_batch_auto() -> None:
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="lora"))
    step = StepSettings(12, 128)
    fits_3 = estimate(facts, replace(step, micro_batch=3)).needed
    assert resolve_micro_batch(facts, step, 12, fits_3)[:2] == (3, 4)  # 12 -> 6 -> 3
    with pytest.raises(MemoryError, match="gradient_checkpointing"):
        resolve_micro_batch(facts, step, 12, 1000)


def test_resolve_micro_batch_enough_tokens() -> None:
    """On CPU auto takes the smallest micro-batch holding enough tokens, not the largest."""
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="lora"))
    step = StepSettings(16, 128)
    big = 10 * estimate(facts, step).peak
    assert resolve_micro_batch(facts, step, 16, big)[:2] == (16, 1)
    # 16 x 128 tokens: 4 rows are the first with 512 tokens, 2 rows are not enough.
    assert resolve_micro_batch(facts, step, 16, big, enough_tokens=512)[:2] == (4, 4)
    assert resolve_micro_batch(facts, step, 16, big, enough_tokens=500)[:2] == (4, 4)
    # More tokens than the whole batch holds: the largest that fits.
    assert resolve_micro_batch(facts, step, 16, big, enough_tokens=10**6)[:2] == (16, 1)
    fits_2 = estimate(facts, replace(step, micro_batch=2)).needed
    assert resolve_micro_batch(facts, step, 16, fits_2, enough_tokens=10**6)[:2] == (2, 8)


def test_parse_size_and_supervised_rows() -> None:
    assert parse_size("24GiB") == 24 * GIB
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5g") == int(1.5 * GIB)
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size("lots")
    assert max_supervised_per_row([[-100, 5, 6], [7, -100, -100]]) == 2


def _config_file(tmp_path: Path, model_dir: Path) -> Path:
    # Unpacked, the 8 examples are 8 rows, so a step takes the whole configured batch of 8
    # (packed, they fill 3 rows, and `plan`, as `train`, would take those 3).
    return plan_config_file(tmp_path, model_dir, "{micro_batch_size: 4, grad_accum: 2}")


def test_auto_config_fields(tmp_path: Path, tiny_llama_dir: Path) -> None:
    cfg = _config_file(tmp_path, tiny_llama_dir)
    # auto is the default, so it needs no global_batch_size: unset is 8 rows per step.
    auto = load_config(cfg, ["train.micro_batch_size=auto"])
    assert configured_global_batch(auto.train) == 8
    with pytest.raises(ConfigError, match="global_batch_size"):
        load_config(cfg, ["train.micro_batch_size=auto", "train.global_batch_size=0"])
    with pytest.raises(ConfigError, match="memory_budget"):
        load_config(cfg, ["train.memory_budget=much"])
    loaded = load_config(cfg, ["train.micro_batch_size=auto", "train.global_batch_size=8"])
    assert loaded.train.micro_batch_size == "auto"


def test_cli_plan_json_and_text(tmp_path: Path, tiny_llama_dir: Path, capsys) -> None:
    cfg = _config_file(tmp_path, tiny_llama_dir)
    assert main(["plan", str(cfg), "--budget", "64GiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    facts = model_facts_for(tiny_llama_config(), "fp32", "sdpa", MethodConfig(name="lora"))
    b = result["configured"]["breakdown"]
    # Under autocast (auto: bf16 where this CPU runs it fastest) the frozen linears are stored
    # in bf16: the tied head stays fp32 with the embedding, the blocks' weights halve.
    low = result["configured"]["precision"] != "fp32"
    assert b["weights"] == facts.weight_bytes - (2 * facts.frozen_linear_params if low else 0)
    assert facts.frozen_linear_params == facts.linear_params > 0 and facts.frozen_head_params == 0
    assert result["fits"] is True and result["budget"] == 64 * GIB
    rec = result["recommended"]
    assert (rec["micro_batch"], rec["grad_accum"], rec["gradient_checkpointing"]) == (4, 2, False)
    # A budget between the runtime baseline and the configured run's needs (each with the
    # allocator's margin): does not fit, and the recommendation keeps 4 x 2 = 8 rows per step.
    tight = (b["needed"] + int(b["overhead"] * b["margin"])) // 2
    assert main(["plan", str(cfg), "--budget", str(tight), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] is False
    rec = result["recommended"]
    assert rec is not None, result
    assert rec["micro_batch"] * rec["grad_accum"] == 8
    assert rec["breakdown"]["needed"] <= tight
    assert main(["plan", str(cfg), "--budget", "64GiB"]) == 0
    text = capsys.readouterr().out
    assert "predicted peak" in text and "fits the cpu budget of 64.00 GiB" in text
    if not torch.cuda.is_available():
        assert main(["plan", str(cfg), "--device", "cuda"]) == 2
        assert "give a budget" in capsys.readouterr().err


def test_train_resolves_auto_and_logs_memory(
    tiny_llama_dir: Path, tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataclasses import replace as dc_replace

    from leantune.monitor.metrics import read_metrics
    from leantune.training.recipe import train

    cfg = load_config(
        _config_file(tmp_path, tiny_llama_dir),
        [
            "train.micro_batch_size=auto",
            "train.global_batch_size=4",
            # 8 unpacked rows: packed, the 8 examples fill 3 rows, fewer than the global batch
            # of 4, and every step would be those 3 rows.
            "data.pack=false",
            "train.max_steps=2",
            f"run.dir={tmp_path / 'run'}",
            "run.progress=false",
            "train.save_every=0",
        ],
    )
    assert cfg.data.train is not None
    data = prepare_rows(cfg.data.train, "chat", tokenizer, 64, False)
    longest = max(len(r.input_ids) for r in data.rows)
    labels = [r.labels for r in data.rows]
    inputs = _basis(cfg, "cpu", max_supervised_per_row(labels), longest)
    peak = {
        mb: estimate(inputs.facts, dc_replace(inputs.step, micro_batch=mb)).needed for mb in (2, 4)
    }
    cfg.train.memory_budget = str((peak[2] + peak[4]) // 2)  # fits 2 rows, not 4
    # The same budget also arms the CPU out-of-memory check on process RSS, and this pytest
    # process's RSS holds every earlier test's objects; that check is tested in test_oom.py.
    import leantune.training.build as build

    unarmed = build.MemoryBudget(None)
    monkeypatch.setattr(build, "MemoryBudget", lambda limit: unarmed)
    logs: list[str] = []
    train(cfg, log=logs.append)
    assert any("micro_batch_size=auto: 2 x grad_accum 2 (global batch 4)" in x for x in logs)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["rss_bytes"] <= r["peak_mem_bytes"] for r in rows)


def test_unpacked_rows_are_planned_at_their_real_length(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """A micro-batch is padded to its longest row: with short unpacked rows the activations are
    those of that length, not of data.max_seq_len."""
    from leantune.training.plan_report import row_stats_from_data

    cfg = load_config(_config_file(tmp_path, tiny_llama_dir), ["data.pack=false"])
    supervised, longest, rows, examples = row_stats_from_data(cfg)
    assert rows == examples == 8  # unpacked
    assert longest is not None and supervised is not None and longest < cfg.data.max_seq_len
    short = _basis(cfg, "cpu", supervised, longest)
    full = _basis(cfg, "cpu", supervised)
    assert (short.step.seq_len, full.step.seq_len) == (longest, cfg.data.max_seq_len)
    assert (
        estimate(short.facts, short.step).activations < estimate(full.facts, full.step).activations
    )


def test_available_optimizers_are_the_installed_low_bit_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from leantune.memory.planner import available_optimizers

    installed = {n for n in ("bitsandbytes", "torchao") if importlib.util.find_spec(n)}
    expected = ["adamw_8bit"] if installed else []
    expected += ["adamw_4bit"] if "torchao" in installed else []
    assert available_optimizers("cpu") == tuple(expected)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("bitsandbytes", "torchao") else real(name, *a),
    )
    assert available_optimizers("cpu") == ()


def test_plan_recommends_low_bit_optimizer_state_when_adamw_does_not_fit(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """A full fine-tune over a budget that adamw misses even at micro-batch 1 with gradient
    checkpointing, and 8-bit state meets: the checklist's next step is the optimizer."""
    from leantune.memory.planner import available_optimizers
    from leantune.training.plan_report import plan

    lighter = available_optimizers("cpu")
    if not lighter:
        pytest.skip("neither bitsandbytes nor torchao is installed")
    cfg = load_config(_config_file(tmp_path, tiny_llama_dir), ["method.name=full"])
    inputs = _basis(cfg, "cpu")
    smallest = replace(inputs.step, micro_batch=1, gradient_checkpointing=True)
    adamw = estimate(inputs.facts, smallest).needed
    low_bit = estimate(inputs.facts, replace(smallest, optimizer=lighter[-1])).needed
    assert low_bit < adamw
    result = plan(cfg, "cpu", str((adamw + low_bit) // 2))
    rec = result["recommended"]
    assert result["fits"] is False and rec is not None, result
    assert rec["method"] == "full" and rec["optimizer"] in ("adamw_8bit", "adamw_4bit"), rec
    assert rec["micro_batch"] * rec["grad_accum"] == 8
    assert rec["breakdown"]["needed"] <= (adamw + low_bit) // 2


def test_gradient_checkpointing_auto_turns_on_only_when_needed(
    tiny_llama_dir: Path, tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gradient_checkpointing=auto (the default): off while micro-batch 1 fits, on when only
    checkpointing makes it fit, and the run then really checkpoints; never for prefix."""
    from dataclasses import replace as dc_replace

    import leantune.training.build as build
    import leantune.training.recipe as recipe
    from leantune.memory.resolve import plan_for_run

    overrides = [
        "data.pack=false",
        "train.micro_batch_size=auto",
        "train.global_batch_size=4",
        "train.max_steps=1",
        f"run.dir={tmp_path / 'run'}",
        "run.progress=false",
        "train.save_every=0",
    ]
    cfg = load_config(_config_file(tmp_path, tiny_llama_dir), overrides)
    assert cfg.train.gradient_checkpointing == "auto"
    assert cfg.data.train is not None
    data = prepare_rows(cfg.data.train, "chat", tokenizer, 64, False)
    labels = [r.labels for r in data.rows]
    longest = max(len(r.input_ids) for r in data.rows)
    inputs = _basis(cfg, "cpu", max_supervised_per_row(labels), longest)
    assert inputs.step.gradient_checkpointing is False

    def peak(mb: int, ckpt: bool) -> int:
        step = dc_replace(inputs.step, micro_batch=mb, gradient_checkpointing=ckpt)
        return estimate(inputs.facts, step).needed

    assert peak(1, True) < peak(1, False)
    roomy = dc_replace(cfg, train=dc_replace(cfg.train, memory_budget=str(10 * peak(4, False))))
    t, memory = plan_for_run(plan_inputs(roomy), "cpu", labels)
    assert t.gradient_checkpointing is False and "checkpointing" not in memory.note
    tight_budget = str((peak(1, True) + peak(1, False)) // 2)
    tight = dc_replace(cfg, train=dc_replace(cfg.train, memory_budget=tight_budget))
    t, memory = plan_for_run(plan_inputs(tight), "cpu", labels)
    assert t.gradient_checkpointing is True and t.micro_batch_size * t.grad_accum == 4
    assert "gradient checkpointing on (gradient_checkpointing=auto)" in memory.note
    # A configured micro-batch: the same decision for it.
    fixed = dc_replace(tight, train=dc_replace(tight.train, micro_batch_size=1, grad_accum=4))
    t, memory = plan_for_run(plan_inputs(fixed), "cpu", labels)
    assert t.gradient_checkpointing is True and "would not fit" in memory.note
    # An explicit false is kept (the prediction then warns), and prefix never checkpoints.
    off = dc_replace(tight, train=dc_replace(tight.train, gradient_checkpointing=False))
    t, memory = plan_for_run(plan_inputs(off), "cpu", labels)
    assert t.gradient_checkpointing is False and memory.note.startswith("warning:")
    prefix = dc_replace(tight, method=dc_replace(tight.method, name="prefix"))
    assert plan_for_run(plan_inputs(prefix), "cpu", labels)[0].gradient_checkpointing is False

    # End to end: the run under the tight budget enables checkpointing on its model.
    calls: list[object] = []
    monkeypatch.setattr(build, "enable_gradient_checkpointing", calls.append)
    unarmed = build.MemoryBudget(None)  # this pytest process's RSS is not the run's
    monkeypatch.setattr(build, "MemoryBudget", lambda limit: unarmed)
    logs: list[str] = []
    recipe.train(tight, log=logs.append)
    assert len(calls) == 1
    assert any("gradient checkpointing on (gradient_checkpointing=auto)" in x for x in logs)
