"""QLoRA's 4-bit base, priced before training: the run log and `leantune plan` give the base
model's held-out loss in its own precision and in 4-bit, equal to the models' own forwards."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import chat_rows, make_config, prepare_rows, run_cli, write_jsonl
from transformers import PreTrainedTokenizerFast

from leantune.models.loading import load_model, resolve_model
from leantune.models.quantize import Quantization
from leantune.training.recipe import train

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed"
)
FP32 = ("method.name=qlora", "method.compute_dtype=fp32", "train.precision=fp32")
LINE = re.compile(r"examples: (\d+\.\d{4}) in fp32 \(model\.dtype\), (\d+\.\d{4}) in 4-bit NF4")


def _forward_loss(model: torch.nn.Module, eval_file: Path, tok: PreTrainedTokenizerFast) -> float:
    """The mean token loss of the first 8 held-out examples from the model's own logits (the
    labels are already shifted: position i predicts labels[i])."""
    examples = prepare_rows(eval_file, "chat", tok, 128, pack=False).examples[:8]
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            logits = model(input_ids=torch.tensor([e.input_ids])).logits[0].float()
            labels = torch.tensor(e.labels)
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


@pytest.fixture
def expected(
    tiny_llama_dir: Path, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> tuple[Path, float, float]:
    """A held-out file of 10 chats and its first 8 examples' loss in fp32 and in 4-bit NF4."""
    eval_file = write_jsonl(tmp_path / "eval.jsonl", chat_rows(10, offset=50))
    source = resolve_model(str(tiny_llama_dir))
    own = _forward_loss(load_model(source, dtype="fp32"), eval_file, tokenizer)
    nf4 = Quantization("nf4", double_quant=True, compute_dtype="fp32")
    four_bit = _forward_loss(
        load_model(source, dtype="fp32", quantization=nf4), eval_file, tokenizer
    )
    assert abs(own - four_bit) > 1e-4  # quantisation moves the loss: the two are told apart
    return eval_file, own, four_bit


def test_run_log_and_plan_give_both_losses(
    tiny_llama_dir: Path, tmp_path: Path, expected: tuple[Path, float, float]
) -> None:
    eval_file, own, four_bit = expected
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    extra = (*FP32, f"data.eval={eval_file}", "train.max_steps=1")
    lines: list[str] = []
    train(make_config(tiny_llama_dir, train_file, tmp_path / "run", *extra), log=lines.append)
    found = [m for x in lines if (m := LINE.search(x))]
    assert len(found) == 1, lines
    assert float(found[0].group(1)) == pytest.approx(own, abs=5e-5)
    assert float(found[0].group(2)) == pytest.approx(four_bit, abs=5e-5)

    args = [f"model.path={tiny_llama_dir}", f"data.train={train_file}", "data.max_seq_len=128"]
    args += [*FP32, f"data.eval={eval_file}", "data.format=chat"]
    plan = run_cli(["plan", "--json", *args])
    assert plan.code == 0, plan.err
    cost = json.loads(plan.out.strip().splitlines()[-1])["quantization_cost"]
    assert (cost["examples"], cost["own_dtype"], cost["quant_type"]) == (8, "fp32", "nf4")
    assert cost["precision"] == "fp32"
    assert cost["own_loss"] == pytest.approx(own, rel=1e-5)
    assert cost["quantized_loss"] == pytest.approx(four_bit, rel=1e-5)
    assert LINE.search(cost["line"]) is not None  # the line the text plan ends with
    # How to skip the measurement, where it is made: it loads the base twice.
    assert "method.measure_quant_cost=false skips this measurement" in cost["line"]
    assert "method.measure_quant_cost=false skips" in found[0].string


def test_without_held_out_data_the_line_says_why(tiny_llama_dir: Path, tmp_path: Path) -> None:
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    lines: list[str] = []
    cfg = make_config(tiny_llama_dir, train_file, tmp_path / "run", *FP32, "train.max_steps=1")
    train(cfg, log=lines.append)
    why = "the 4-bit base's cost is not measured: data.eval is not set"
    assert sum(why in x for x in lines) == 1, lines
    args = [f"model.path={tiny_llama_dir}", f"data.train={train_file}", *FP32]
    plan = run_cli(["plan", *args])
    assert plan.code == 0 and why in plan.out


def test_no_room_for_the_unquantised_base_is_said_and_the_run_goes_on(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import leantune.training.quant_cost as quant_cost

    def no_room(*args: object, **kwargs: object) -> dict[str, float]:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(quant_cost, "evaluate_loss", no_room)
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    eval_file = write_jsonl(tmp_path / "eval.jsonl", chat_rows(2, offset=50))
    extra = (*FP32, f"data.eval={eval_file}", "train.max_steps=1")
    lines: list[str] = []
    train(make_config(tiny_llama_dir, train_file, tmp_path / "run", *extra), log=lines.append)
    assert sum(quant_cost.NO_ROOM in x for x in lines) == 1, lines
    assert (tmp_path / "run" / "summary.json").is_file()


def test_measure_quant_cost_false_loads_the_base_once_and_says_so(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import leantune.training.quant_cost as quant_cost

    loads: list[object] = []
    real = quant_cost.base_model

    def counted(*args: object, **kwargs: object) -> torch.nn.Module:
        loads.append(args[2])  # the quantization: None for the model.dtype copy
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(quant_cost, "base_model", counted)
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    eval_file = write_jsonl(tmp_path / "eval.jsonl", chat_rows(2, offset=50))
    off = (*FP32, f"data.eval={eval_file}", "method.measure_quant_cost=false")
    lines: list[str] = []
    cfg = make_config(tiny_llama_dir, train_file, tmp_path / "run", *off, "train.max_steps=1")
    train(cfg, log=lines.append)
    why = "the 4-bit base's cost is not measured: method.measure_quant_cost=false"
    assert sum(why in x for x in lines) == 1 and not any(LINE.search(x) for x in lines), lines
    assert len(loads) == 1 and loads[0] is not None  # the 4-bit base only
    plan = run_cli(["plan", f"model.path={tiny_llama_dir}", f"data.train={train_file}", *off])
    assert plan.code == 0 and why in plan.out, plan
    assert len(loads) == 1  # plan loaded nothing to measure
