"""The method registry: one `MethodSpec` per method, the same names everywhere, and every fact a
spec states is what its method does (on the tiny model) or what validation enforces."""

from __future__ import annotations

import ast
import re
import typing
import warnings
from pathlib import Path

import pytest
import torch

from leantune.config import ConfigError, MethodConfig, field_docs
from leantune.export.source import ExportError, merge_into_base, model_logits_fn
from leantune.memory.planner import METHOD_LADDER
from leantune.methods.checks import effective_pack
from leantune.methods.registry import (
    DEFAULT_LR,
    METHODS,
    apply_method,
    base_quantization,
    count_parameters,
    trainable_named_parameters,
)
from leantune.models.loading import ModelSource, enable_gradient_checkpointing, load_model
from leantune.models.loss import VIRTUAL_TOKENS_HOOK, supervised_logits
from leantune.training.checks import check_config, load_config

ROOT = Path(__file__).resolve().parents[3]
NAMES = sorted(METHODS)
# Each method's default rate, from the sweeps in benchmarks/results/sweep-*-cpu.md.
DEFAULTS_LR = {
    "full": 1e-4,
    "lora": 2e-3,
    "dora": 2e-3,
    "qlora": 6e-4,
    "ia3": 1e-2,
    "freeze": 1e-3,
    "adapter": 2e-3,
    "prefix": 3e-4,
    "ptuning_v2": 3e-2,
    "prompt": 3e-2,
}
IDS = torch.tensor([[5, 17, 42, 7, 99, 3, 11, 23]])


def _documented_methods() -> dict[str, str]:
    """The methods guide's table (docs/guides/methods.md): name -> its "what trains" column."""
    text = (ROOT / "docs" / "guides" / "methods.md").read_text(encoding="utf-8")
    table = text.split("# Methods (`method.name`)", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return {
        m.group(1): m.group(2).strip()
        for row in rows
        if (m := re.match(r"\| `([^`]+)` \|([^|]*)\|", row))
    }


def _cfg(name: str, *extra: str) -> MethodConfig:
    return load_config(
        None, [f"method.name={name}", "data.pack=false", "method.num_virtual_tokens=4", *extra]
    ).method


def _applied(name: str, model_dir: Path, *extra: str) -> torch.nn.Module:
    """The method applied to the base as the recipe loads it, its weights moved off their init."""
    method = _cfg(name, *extra)
    base = load_model(ModelSource(str(model_dir)), quantization=base_quantization(method, "fp32"))
    torch.manual_seed(0)
    model = apply_method(base, method)
    with torch.no_grad():
        for p in trainable_named_parameters(model).values():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _needs_bnb(name: str) -> None:
    if METHODS[name].base_quantization is not None:
        pytest.importorskip("bitsandbytes")


def test_config_registry_and_methods_guide_name_the_same_methods() -> None:
    choices = typing.get_args(typing.get_type_hints(MethodConfig)["name"])
    documented = _documented_methods()
    assert set(choices) == set(METHODS) == set(documented)
    assert all(spec.name == name for name, spec in METHODS.items())
    assert {name: spec.description for name, spec in METHODS.items()} == documented
    assert MethodConfig().name in METHODS


def test_default_learning_rates_are_the_measured_ones() -> None:
    assert {name: spec.default_lr for name, spec in METHODS.items()} == DEFAULTS_LR
    assert DEFAULT_LR == DEFAULTS_LR
    # train.lr's help ("default by method: full/freeze 2e-5, ...") says the same.
    listed = re.findall(r"([a-z0-9_/]+) (\d+e-\d+)", field_docs()["train.lr"])
    documented = {name: float(lr) for names, lr in listed for name in names.split("/")}
    assert documented == DEFAULT_LR


@pytest.mark.parametrize("name", NAMES)
def test_validation_follows_the_spec(name: str) -> None:
    spec = METHODS[name]
    if spec.base_quantization is not None:
        pytest.importorskip("bitsandbytes")  # validation refuses the method without it
    # Packing: refused (and not chosen by auto) exactly when the spec needs unpacked rows.
    assert effective_pack("auto", name) is not spec.needs_unpacked_data
    if spec.needs_unpacked_data:
        with pytest.raises(ConfigError, match=rf"method.name={name} needs data.pack=false"):
            load_config(None, [f"method.name={name}", "data.pack=true"])
    else:
        load_config(None, [f"method.name={name}", "data.pack=true"])
    # Gradient checkpointing, the KL term, a large LoRA rank, a high learning rate.
    ckpt = ["train.gradient_checkpointing=true"]
    if spec.supports_gradient_checkpointing:
        _cfg(name, *ckpt)
    else:
        with pytest.raises(ConfigError, match="gradient_checkpointing does not work with"):
            _cfg(name, *ckpt)
    if spec.kl_capable:
        _cfg(name, "train.kl_coef=0.1")
    else:
        with pytest.raises(ConfigError, match=r"train\.kl_coef needs an adapter method"):
            _cfg(name, "train.kl_coef=0.1")
    cfg = load_config(None, [f"method.name={name}", "data.pack=false", "method.r=128"])
    assert any("LoRA ranks above 64" in w for w in check_config(cfg)) is spec.lora_settings
    cfg = load_config(None, [f"method.name={name}", "data.pack=false", "train.lr=3e-4"])
    high = [w for w in check_config(cfg) if "is high for" in w]
    assert bool(high) is (spec.lr_advice is not None)
    # The method's own default never draws the warning, set explicitly or not.
    cfg = load_config(
        None, [f"method.name={name}", "data.pack=false", f"train.lr={spec.default_lr}"]
    )
    assert not [w for w in check_config(cfg) if "is high for" in w]
    # The methods' own checks: freeze with nothing to train, a prompt-learning init text that a
    # random init would ignore; each is refused by its methods only.
    cases = {
        "trains nothing": (["method.last_blocks=0", "method.norms=false"], {"freeze"}),
        "prompt_init_text is ignored": (
            ["method.prompt_init=random", "method.prompt_init_text=hi"],
            {"prefix", "ptuning_v2", "prompt"},
        ),
    }
    for message, (extra, refusing) in cases.items():
        if name in refusing:
            assert spec.check is not None
            with pytest.raises(ConfigError, match=message):
                _cfg(name, *extra)
        else:
            _cfg(name, *extra)


@pytest.mark.parametrize("name", NAMES)
def test_the_wrapped_model_is_what_the_spec_says(name: str, tiny_llama_dir: Path) -> None:
    _needs_bnb(name)
    spec = METHODS[name]
    model = _applied(name, tiny_llama_dir)
    quant = base_quantization(_cfg(name), "fp32")
    assert (quant is not None) is (spec.base_quantization is not None)
    assert (spec.planned_weight_quant is not None) is (quant is not None)
    base_names = {n for n, _ in load_model(ModelSource(str(tiny_llama_dir))).named_parameters()}
    trains_own = set(trainable_named_parameters(model)) <= base_names
    assert trains_own is spec.trains_base_weights
    assert callable(getattr(model, "disable_adapter", None)) is spec.kl_capable
    assert hasattr(model, VIRTUAL_TOKENS_HOOK) is spec.needs_unpacked_data


@pytest.mark.parametrize("name", NAMES)
def test_gradient_checkpointing_works_where_the_spec_says(name: str, tiny_llama_dir: Path) -> None:
    _needs_bnb(name)
    model = _applied(name, tiny_llama_dir)
    batch = {"input_ids": IDS, "labels": IDS, "position_ids": torch.arange(IDS.shape[1])[None]}
    with torch.no_grad():
        plain = supervised_logits(model, batch)
    enable_gradient_checkpointing(model)
    model.train()
    if not METHODS[name].supports_gradient_checkpointing:
        with pytest.raises(RuntimeError, match="size of tensor"):  # the prefix cache is gone
            supervised_logits(model, batch)
        return
    torch.testing.assert_close(supervised_logits(model, batch), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_mergeable_methods_merge_into_one_plain_model(
    name: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    _needs_bnb(name)
    model = _applied(name, tiny_llama_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own prefix forward: deprecated kwargs
        want = model_logits_fn(model)(IDS)
    adapter_dir = None
    if METHODS[name].base_quantization is not None:  # export reloads a 4-bit base's adapter
        adapter_dir = tmp_path / "adapter"
        model.save_pretrained(adapter_dir)
    base_keys = set(load_model(ModelSource(str(tiny_llama_dir))).state_dict())
    if not METHODS[name].mergeable:
        try:
            merged, _ = merge_into_base(model, adapter_dir)
        except ExportError as e:
            assert "cannot be merged" in str(e)
        else:  # bottleneck adapters stay modules of their own beside the base weights
            assert set(merged.state_dict()) - base_keys
        return
    merged, _ = merge_into_base(model, adapter_dir)
    assert set(merged.state_dict()) == base_keys
    torch.testing.assert_close(model_logits_fn(merged)(IDS), want, atol=1e-4, rtol=0)


def test_planner_facts(tiny_llama_dir: Path) -> None:
    # What `leantune plan` offers and counts, as before the specs.
    assert METHOD_LADDER == ("lora", "qlora")
    assert {n: s.planned_as for n, s in METHODS.items() if s.planned_as} == {"qlora": "lora"}
    assert {n for n, s in METHODS.items() if s.lighter_than_fallbacks} == {"ia3"}
    lora = count_parameters(_applied("lora", tiny_llama_dir))[0]
    for name, spec in METHODS.items():
        if spec.planned_as is not None:  # counts the same trainable parameters as that method
            _needs_bnb(name)
            assert (
                count_parameters(_applied(name, tiny_llama_dir))[0]
                == count_parameters(_applied(spec.planned_as, tiny_llama_dir))[0]
            )
        if spec.lighter_than_fallbacks:  # trains fewer parameters than any fallback
            assert count_parameters(_applied(name, tiny_llama_dir))[0] < lora


def _method_name_comparisons(path: Path) -> list[str]:
    """Comparisons of something named like a method with method-name literals in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        literals = {
            c.value
            for side in sides
            for c in ([side] if isinstance(side, ast.Constant) else getattr(side, "elts", []))
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        }
        others = " ".join(ast.unparse(s) for s in sides if not isinstance(s, ast.Constant))
        if literals & set(METHODS) and re.search(r"method|\bm\b|name", others):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_branches_on_a_method_name() -> None:
    # The benchmark compares every method with full fine-tuning: a baseline, not a branch.
    # Benchmarks compare against full fine-tuning, and the HF baseline builds its own LoRA.
    allowed = {
        ROOT / "src/leantune/bench/methods.py",
        ROOT / "src/leantune/bench/hf_baseline.py",
        ROOT / "src/leantune/bench/throughput.py",
    }
    found = [
        hit
        for path in sorted((ROOT / "src/leantune").rglob("*.py"))
        if path not in allowed
        for hit in _method_name_comparisons(path)
    ]
    assert found == []
