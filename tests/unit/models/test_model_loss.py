"""The training loss is the model's own loss on every architecture.

The loss runs the decoder and the output projection itself (only at supervised positions), so
whatever a model does between the projection and its logits must be honoured: Gemma 2's
final-logit soft-capping, Cohere's and Granite's logit scaling, and - through the check made
once per model - anything else, by falling back to the model's own forward. The reference
everywhere is `F.cross_entropy(model(...).logits)` and autograd's gradients through it, with
logits of realistic size (tens), where soft-capping and scaling change the loss by a lot.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from model_zoo import FAMILIES, OUTPUT_SCALED_FAMILIES, Family, plant_chats, save_family_model
from peft import LoraConfig, get_peft_model
from support import make_config, write_jsonl
from torch import nn
from transformers import AutoModelForCausalLM

from leantune.data.packing import Row
from leantune.data.tokenize import IGNORE_INDEX
from leantune.eval.perplexity import evaluate_loss
from leantune.methods.registry import apply_method, trainable_named_parameters
from leantune.models.loading import ModelSource, load_model
from leantune.models.loss import supervised_logits, token_loss_sum
from leantune.models.output_head import (
    OUTPUT_HEAD_ATTR,
    OutputHead,
    decide_output_head,
    output_head,
)
from leantune.training.checks import load_config
from leantune.training.recipe import train

ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **OUTPUT_SCALED_FAMILIES}

INIT = 1.0
"""initializer_range of the test models: large enough that the logits reach tens."""


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def _model_dir(root: Path, name: str) -> Path:
    out = root / name
    if not (out / "config.json").is_file():
        save_family_model(out, ALL_FAMILIES[name], seed=0, initializer_range=INIT)
    return out


def _load(root: Path, name: str) -> nn.Module:
    # eager: the one attention every family accepts (Gemma 2 refuses sdpa and segments).
    model = load_model(ModelSource(str(_model_dir(root, name))), attn_implementation="eager")
    model.eval()  # no dropout: both paths see the same function
    return model


def _batch(vocab: int, rows: int = 2, length: int = 24, prompt: int = 8) -> dict[str, Any]:
    """Unpadded rows; the labels (already shifted) cover the answer part of each row."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, prompt:-1] = ids[:, prompt + 1 :]
    positions = torch.arange(length).expand(rows, length).clone()
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _own_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own forward loss (sum over supervised positions) and its logits there."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    mask = batch["labels"] != IGNORE_INDEX
    logits = out.logits[mask].float()
    return F.cross_entropy(logits, batch["labels"][mask], reduction="sum"), logits


def _grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_loss_and_grads(model: nn.Module, batch: dict[str, Any]) -> None:
    got = token_loss_sum(model, batch)
    got_grads = _grads(model, got)
    ref, logits = _own_loss(model, batch)
    ref_grads = _grads(model, ref)
    assert logits.abs().max() > 10, "the test needs logits of realistic size"
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-4)
    assert got_grads.keys() == ref_grads.keys()
    for name, g in got_grads.items():
        scale = float(ref_grads[name].abs().max())
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("name", sorted(ALL_FAMILIES))
def test_training_loss_and_gradients_are_the_models_own(zoo_dir: Path, name: str) -> None:
    model = _load(zoo_dir, name)
    batch = _batch(model.config.vocab_size)
    _assert_same_loss_and_grads(model, batch)
    with torch.no_grad():  # evaluation (perplexity) and the KL term read the same logits
        ref, logits = _own_loss(model, batch)
        torch.testing.assert_close(token_loss_sum(model, batch), ref, rtol=2e-6, atol=1e-4)
        torch.testing.assert_close(supervised_logits(model, batch), logits, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "scale", "softcap"),
    [("gemma2", 1.0, 30.0), ("cohere", 0.5, None), ("granite", 0.5, None), ("llama3", 1.0, None)],
)
def test_known_transforms_keep_the_chunked_path(
    zoo_dir: Path, name: str, scale: float, softcap: float | None
) -> None:
    head = getattr(_load(zoo_dir, name), OUTPUT_HEAD_ATTR)  # decided by the loader
    assert not head.own_forward, head.note
    assert (head.scale, head.softcap) == (scale, softcap)


def _halved_logits(module: nn.Module, args: Any, output: Any) -> Any:
    """A transform no table knows: the model's forward halves its logits."""
    output.logits = output.logits * 0.5
    return output


def test_an_unknown_transform_trains_on_the_models_own_forward(zoo_dir: Path) -> None:
    path = _model_dir(zoo_dir, "qwen2.5")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    model.register_forward_hook(_halved_logits)
    batch = _batch(model.config.vocab_size)
    _assert_same_loss_and_grads(model, batch)  # decided on first use: the model's own forward
    head = output_head(model)
    assert head.own_forward
    assert head.note is not None and "own forward" in head.note


def test_the_loader_decides_and_a_new_decision_sees_a_later_change(zoo_dir: Path) -> None:
    model = _load(zoo_dir, "qwen2.5")
    assert getattr(model, OUTPUT_HEAD_ATTR, None) == OutputHead()  # decided at load: identity
    model.register_forward_hook(_halved_logits)
    assert decide_output_head(model).own_forward
    _assert_same_loss_and_grads(model, _batch(model.config.vocab_size))


def test_adapters_read_the_decision_of_their_base_model(zoo_dir: Path) -> None:
    base = _load(zoo_dir, "gemma2")
    decided = output_head(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for module in model.modules():  # a trained adapter: the base alone would not match
        if hasattr(module, "lora_B"):
            nn.init.normal_(module.lora_B["default"].weight, std=0.5)
    assert output_head(model) is decided
    _assert_same_loss_and_grads(model, _batch(base.config.vocab_size))


def _with_virtual_tokens(model: nn.Module, name: str) -> nn.Module:
    """`name` (prompt or prefix tuning) applied, its weights moved off their init."""
    cfg = load_config(
        None, [f"method.name={name}", "data.pack=false", "method.num_virtual_tokens=4"]
    )
    torch.manual_seed(0)
    model = apply_method(model, cfg.method).eval()
    with torch.no_grad():
        for p in trainable_named_parameters(model).values():
            p.add_(torch.randn_like(p) * 2.0)
    return model


@pytest.mark.parametrize(
    ("family", "method", "unknown"),
    [("gemma2", "prompt", False), ("qwen2.5", "prompt", True), ("qwen2.5", "prefix", True)],
)
def test_virtual_tokens_get_the_same_output_transform(
    zoo_dir: Path, family: str, method: str, unknown: bool
) -> None:
    """Prompt and prefix tuning: the loss equals peft's own forward, with Gemma 2's soft-capping
    (the chunked path) and with a transform only the model's forward knows (the fallback)."""
    path = _model_dir(zoo_dir, family)
    base = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    if unknown:
        base.register_forward_hook(_halved_logits)
    model = _with_virtual_tokens(base, method)
    batch = _batch(base.config.vocab_size)
    width, mask = batch["input_ids"].shape[1], batch["labels"] != IGNORE_INDEX
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own forward: deprecated kwargs in transformers 5
        ours = supervised_logits(model, batch)
        reference = model(input_ids=batch["input_ids"]).logits[:, -width:][mask].float()
        loss = token_loss_sum(model, batch)
    assert output_head(model).own_forward is unknown
    assert reference.abs().max() > 10
    torch.testing.assert_close(ours.float(), reference, rtol=1e-5, atol=1e-4)
    expected = F.cross_entropy(reference, batch["labels"][mask], reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=2e-6, atol=1e-4)


def test_perplexity_is_the_models_own(zoo_dir: Path) -> None:
    model = _load(zoo_dir, "gemma2")
    batch = _batch(model.config.vocab_size)
    rows = [
        Row(input_ids=ids.tolist(), labels=labels.tolist(), position_ids=pos.tolist())
        for ids, labels, pos in zip(
            batch["input_ids"], batch["labels"], batch["position_ids"], strict=True
        )
    ]
    with torch.no_grad():
        ref, logits = _own_loss(model, batch)
    got = evaluate_loss(model, rows, pad_id=0)
    assert got["loss"] == pytest.approx(float(ref) / logits.shape[0], rel=1e-5)


HALVED_MODEL_CODE = '''
from transformers import Qwen2ForCausalLM


class HalvedForCausalLM(Qwen2ForCausalLM):
    """A model of its own code that halves its logits: nothing in its config says so."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out
'''


def test_a_model_of_its_own_code_trains_on_its_own_forward_and_says_so(
    zoo_dir: Path, tmp_path: Path
) -> None:
    """The loader's check catches a transform no table knows (trust_remote_code), the loss
    follows the model's own forward, and the run's log says so once."""
    model_dir = tmp_path / "halved"
    shutil.copytree(_model_dir(zoo_dir, "qwen2.5"), model_dir)
    (model_dir / "modeling_halved.py").write_text(HALVED_MODEL_CODE)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_halved.HalvedForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    source = ModelSource(str(model_dir))
    model = load_model(source, trust_remote_code=True, attn_implementation="eager").eval()
    assert type(model).__name__ == "HalvedForCausalLM"
    assert getattr(model, OUTPUT_HEAD_ATTR).own_forward
    _assert_same_loss_and_grads(model, _batch(model.config.vocab_size))

    data = write_jsonl(tmp_path / "chat.jsonl", plant_chats(8))
    cfg = make_config(
        model_dir,
        data,
        tmp_path / "run",
        "model.trust_remote_code=true",
        "model.attn_implementation=eager",
        "train.max_steps=1",
        "data.max_seq_len=256",
    )
    lines: list[str] = []
    train(cfg, log=lines.append)
    notes = [line for line in lines if "own forward" in line]
    assert len(notes) == 1 and "HalvedForCausalLM" in notes[0], lines
