"""The memory planner on a preference run (issue 34): a packed row holds a pair's two answers
(up to twice data.max_seq_len), and the reference's forward without grad runs on every
micro-batch (adapters) or once over the data before training (full, freeze). Predictions are
compared with the live tensors of real DPO steps on a tiny model, counted op by op."""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from support import tiny_llama_config, write_jsonl
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from leantune.cli.app import main
from leantune.config import Config, MethodConfig
from leantune.memory.estimate import StepSettings, estimate
from leantune.memory.inputs import max_supervised_per_row, model_facts_for, plan_basis
from leantune.memory.planner import recommend
from leantune.memory.resolve import plan_for_run
from leantune.methods.registry import apply_method
from leantune.models.attention import transformers_name
from leantune.models.loading import load_tokenizer, resolve_model
from leantune.models.loss import token_loss_sum
from leantune.objectives.batch import MODEL_INPUTS, with_live_reference, with_reference
from leantune.training.checks import load_config
from leantune.training.planning import plan_inputs
from leantune.training.preference_setup import load_preference_data
from leantune.training.run_setup import with_objective_format

# Long answers, so that the rows' tokens (not the fixed chunk of logits) size the step.
PAIRS = [
    {
        "prompt": f"Question {i}: " + "tell me more " * (4 + i),
        "chosen": "Here is the answer " * (6 + i),
        "rejected": "No " * (3 + 2 * i),
    }
    for i in range(6)
]
TOLERANCE = 0.1
"""The reference pass's predicted live tensors within 10% of the counted ones (the planner's
per-block activations are within 1%, DoRA's 8%)."""


class LiveTensors(TorchDispatchMode):
    """Counts the bytes of the storages that ops create while they are alive, and their peak;
    the model's own parameters and buffers are left out."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            # A view shares its base's storage: counted once, when that was made.
            if storage.nbytes() == 0 or key in self.sizes or key in self.own:
                continue
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key)
        return out


def _config(tmp_path: Path, model_dir: Path, method: str, *extra: str) -> Config:
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.train={data}",
            "data.max_seq_len=auto",
            "train.objective=dpo",
            f"method.name={method}",
            "method.dropout=0",
            f"run.dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def _setup(cfg: Config) -> tuple[Any, Any, int]:
    """(planner basis, the preference step, data.max_seq_len resolved) for `cfg`'s data."""
    cfg = with_objective_format(cfg)
    source = resolve_model(cfg.model.path, None)
    tok = load_tokenizer(source)
    prepared, run, max_seq_len = load_preference_data(cfg, tok, 512, lambda _: None)
    cfg = replace(cfg, data=replace(cfg.data, max_seq_len=max_seq_len))
    labels = [r.labels for r in prepared.rows]
    longest = max(len(r) for r in labels)
    basis = plan_basis(plan_inputs(cfg), "cpu", max_supervised_per_row(labels), longest)
    return basis, run.step(cfg), max_seq_len


def test_a_pair_row_is_planned_with_both_answers(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """data.max_seq_len bounds one prompt and answer; a row holds the pair's two, so the plan
    sizes rows up to twice it (it cut them at max_seq_len: half the activations)."""
    cfg = _config(tmp_path, tiny_llama_dir, "lora", "data.pack=false")
    basis, step, max_seq_len = _setup(cfg)
    longest = max(len(r.input_ids) for r in step.rows)
    assert max_seq_len < longest <= 2 * max_seq_len
    assert basis.step.seq_len == longest
    assert basis.step.reference == "forward"
    # Without data, rows of twice data.max_seq_len; an sft run's rows stay at it.
    fixed = replace(cfg, data=replace(cfg.data, max_seq_len=100))
    assert plan_basis(plan_inputs(fixed), "cpu").step.seq_len == 200
    sft = replace(fixed, train=replace(fixed.train, objective="sft"))
    assert plan_basis(plan_inputs(sft), "cpu").step.reference == "none"
    assert plan_basis(plan_inputs(sft), "cpu").step.seq_len == 100
    simpo = replace(fixed, train=replace(fixed.train, objective="simpo"))
    assert plan_basis(plan_inputs(simpo), "cpu").step.reference == "none"
    full = replace(fixed, method=replace(fixed.method, name="full"))
    assert plan_basis(plan_inputs(full), "cpu").step.reference == "precomputed"
    # train's log line names the reference's share.
    labels = [r.labels for r in step.rows]
    assert "reference forward" in plan_for_run(plan_inputs(cfg), "cpu", labels)[1].note


def _model(cfg: Config, attention: str, method: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    model.set_attn_implementation(transformers_name(attention))
    model = apply_method(model, MethodConfig(name=method, dropout=0.0))  # type: ignore[arg-type]
    # LoRA's B starts at 0: a non-zero one makes the policy differ from its reference.
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.train()


def _counted_peak(model: torch.nn.Module, precision: str, work: Callable[[], torch.Tensor]) -> int:
    """Peak live bytes of `work()` (under the run's autocast) and its loss's backward."""
    counted = LiveTensors(model)
    with counted:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = work()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counted.peak


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("method", "reference"), [("lora", "auto"), ("full", "auto"),
                                                   ("full", "live")])  # fmt: skip
def test_a_dpo_steps_live_tensors_are_the_plans(
    tmp_path: Path, tiny_llama_dir: Path, method: str, reference: str, precision: str
) -> None:
    """One micro-batch of every packed pair: the policy's forward, the reference's (LoRA: the
    same model with its adapters off; full: precomputed before training, its peak counted
    apart; full with train.reference=live: a frozen copy of the model, whose bytes the plan
    counts exactly), the DPO loss and its backward. The live tensors above the weights peak
    where the plan says (activations plus the larger of the loss and the reference forward, or
    the gradients), as close as an SFT step on the same rows is to its plan: the loss term is
    an upper bound (+10% to +26% here), never 5% under."""
    extra = (f"train.precision={precision}", f"train.reference={reference}")
    cfg = _config(tmp_path, tiny_llama_dir, method, *extra)
    basis, step, _ = _setup(cfg)
    rows = list(range(len(step.rows)))
    st = replace(basis.step, micro_batch=len(rows), reference_rows=len(rows))
    b = estimate(basis.facts, st, basis.weight_itemsize)
    model = _model(cfg, st.attn_implementation, method)
    if reference == "live":
        step = with_live_reference(step, model)
        assert step.reference_model is not None
        frozen = [*step.reference_model.parameters(), *step.reference_model.buffers()]
        assert b.reference_copy == sum(t.numel() * t.element_size() for t in frozen)
        assert b.reference > 0 and b.reference_pass == 0
    elif method == "full":
        counted = LiveTensors(model)
        with counted, torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            step = with_reference(step, model, torch.device("cpu"), precision, pad_id=0)
        assert b.reference == 0
        pass_predicted = b.reference_pass - b.overhead - b.weights
        assert pass_predicted == pytest.approx(counted.peak, rel=TOLERANCE)
        assert b.needed >= int(b.reference_pass * b.margin)
    else:
        assert b.reference > 0 and b.reference_pass == 0
    mb = step.collate(rows, pad_id=0)
    batch = {k: mb.tensors[k] for k in MODEL_INPUTS}
    sft = estimate(basis.facts, replace(st, reference="none"), basis.weight_itemsize)
    sft_ratio = max(sft.backward_phase, sft.gradients) / _counted_peak(
        model, precision, lambda: token_loss_sum(model, batch)
    )
    dpo_ratio = max(b.backward_phase, b.gradients) / _counted_peak(
        model, precision, lambda: step.output(model, mb).loss(mb.examples, mb.nll_tokens)
    )
    assert 1 - TOLERANCE / 2 <= dpo_ratio <= sft_ratio + TOLERANCE / 2, (dpo_ratio, sft_ratio, b)


def test_plan_shows_a_dpo_runs_rows_and_reference(
    tmp_path: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`leantune plan` on a DPO config reads the pairs as `train` packs them and shows the
    reference: its forward per micro-batch (LoRA), its pass before training (full)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    config = tmp_path / "dpo.yaml"
    config.write_text(
        f"model: {{path: {tiny_llama_dir}}}\ndata: {{train: {data}, max_seq_len: auto}}\n"
        "train: {objective: dpo, micro_batch_size: 1, grad_accum: 1}\n"
    )
    cfg = load_config(config, [f"run.dir={tmp_path / 'run'}"])
    basis, step, _ = _setup(cfg)
    assert main(["plan", str(config), "--budget", "64GiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    c = result["configured"]
    assert c["seq_len"] == basis.step.seq_len == max(len(r.input_ids) for r in step.rows)
    assert c["supervised_per_row"] == max_supervised_per_row([r.labels for r in step.rows])
    assert c["breakdown"]["reference"] > 0 and c["breakdown"]["reference_pass"] == 0
    assert main(["plan", str(config), "--budget", "64GiB"]) == 0
    assert "reference forward (no grad)" in capsys.readouterr().out
    assert main(["plan", str(config), "--budget", "64GiB", "method.name=full"]) == 0
    text = capsys.readouterr().out
    assert "reference pass before training" in text
    assert "reference copy (train.reference=live)       0.000 GiB" in text
    live = ["method.name=full", "train.reference=live"]
    assert main(["plan", str(config), "--budget", "64GiB", *live]) == 0
    assert "reference pass before training" not in capsys.readouterr().out
    assert main(["plan", str(config), "--budget", "64GiB", "--json", *live]) == 0
    b = json.loads(capsys.readouterr().out)["configured"]["breakdown"]
    assert b["reference_copy"] == b["weights"] > 0 and b["reference_pass"] == 0


def test_a_recommended_method_brings_its_own_reference() -> None:
    """A full DPO run that does not fit falls back to LoRA, whose reference is a forward per
    micro-batch, not the pass before training that full fine-tuning needs."""
    config = tiny_llama_config()
    full = model_facts_for(config, "fp32", "segments", MethodConfig(name="full"))
    lora = model_facts_for(config, "fp32", "segments", MethodConfig(name="lora"))
    step = StepSettings(4, 256, attn_implementation="segments", reference="precomputed")
    step = replace(step, reference_rows=8)
    smallest = replace(step, micro_batch=1, gradient_checkpointing=True)
    budget = estimate(full, smallest).needed - 1  # full fine-tuning fits no settings
    plan = recommend({"full": full, "lora": lora}, "full", step, 4, budget)
    assert plan is not None and plan.method == "lora", plan
    assert plan.breakdown.reference > 0 and plan.breakdown.reference_pass == 0
    kept = recommend({"full": full}, "full", step, 4, 10 * budget)
    assert kept is not None and kept.breakdown.reference_pass > 0 == kept.breakdown.reference


def test_train_reference_live_plans_the_frozen_copy_of_the_weights(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """train.reference=live keeps a frozen copy of the model beside it (full, freeze): the plan
    grows by that copy's bytes (the weights) and runs the reference forward per micro-batch, with
    no pass before training. cached (auto there) and adapter methods keep no copy."""
    plans = {}
    for method, reference in [("full", "auto"), ("full", "cached"), ("full", "live"),
                              ("freeze", "live"), ("freeze", "auto"),
                              ("lora", "auto"), ("lora", "live")]:  # fmt: skip
        cfg = _config(tmp_path, tiny_llama_dir, method, f"train.reference={reference}")
        fixed = replace(cfg, data=replace(cfg.data, max_seq_len=64))
        basis = plan_basis(plan_inputs(fixed), "cpu")
        plans[method, reference] = estimate(basis.facts, basis.step, basis.weight_itemsize)
    cached, live = plans["full", "cached"], plans["full", "live"]
    assert plans["full", "auto"] == cached and cached.reference_copy == 0
    assert live.reference_copy == live.weights > 0
    assert live.reference > 0 and live.reference_pass == 0 < cached.reference_pass
    # The copy, and the forward's transient where it exceeds the loss's.
    grown = live.peak - cached.peak
    assert live.weights <= grown <= live.weights + live.reference, (grown, live)
    assert live.needed > cached.needed
    frozen = plans["freeze", "live"]
    assert frozen.reference_copy == frozen.weights
    assert frozen.peak - plans["freeze", "auto"].peak >= frozen.weights
    assert plans["lora", "live"] == plans["lora", "auto"]
    assert plans["lora", "live"].reference_copy == 0
