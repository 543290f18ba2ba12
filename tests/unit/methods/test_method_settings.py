"""Method settings that would make training a no-op, or that name layers the model does not have,
are refused before any weight loads, naming the field and the fix.

`method.alpha=0` would train with every LoRA update scaled by 0 (every gradient 0, exit 0) and
`method.target_modules=[]` would end in peft's NoMatchingPeftModuleError traceback: both are
config errors; IA3 refusing a name that is not a linear layer says which ones are.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from support import chat_rows, run_cli, tiny_llama_config, tiny_train_args, write_jsonl
from transformers import AutoModelForCausalLM

from leantune.config import MethodConfig
from leantune.config.parse import ConfigError
from leantune.methods.errors import MethodError
from leantune.methods.registry import METHODS, apply_method
from leantune.training.checks import load_config

# Every setting that leaves a method nothing to train, and the method it applies to.
INERT = [
    ("lora", "method.alpha=0", "method.alpha: must be >= 1"),  # scaling alpha/r = 0
    ("dora", "method.alpha=0", "method.alpha: must be >= 1"),
    ("qlora", "method.alpha=-16", "method.alpha: must be >= 1"),  # a negated update
    ("lora", "method.target_modules=[]", "method.target_modules: an empty list"),
    ("ia3", "method.target_modules=[]", "method.target_modules: an empty list"),
    ("lora", "method.target_modules=[all-linear, lm_head]", "all-linear stands alone"),
    ("lora", "method.r=0", "method.r: must be >= 1"),
    ("lora", "method.dropout=1.0", "method.dropout: must be in [0, 1)"),
    ("lora", "train.lr=0", "train.lr: must be in (0, 1)"),
    ("prompt", "method.num_virtual_tokens=0", "method.num_virtual_tokens: must be >= 1"),
    ("prefix", "method.prefix_hidden_size=0", "method.prefix_hidden_size: must be >= 1"),
    ("adapter", "method.adapter_reduction=0", "method.adapter_reduction: must be >= 1"),
    ("freeze", "method.last_blocks=0|method.norms=false", "method.name=freeze trains nothing"),
    ("prompt", "method.prompt_init_text=' '", "method.prompt_init_text: empty"),
]


@pytest.mark.parametrize(("method", "override", "needle"), INERT)
def test_settings_that_make_a_method_inert_are_refused(
    tmp_path: Path, method: str, override: str, needle: str
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [])
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.train={data}", f"method.name={method}", *override.split("|")])
    assert needle in str(err.value)


def test_alpha_and_targets_are_refused_before_anything_loads(tmp_path: Path) -> None:
    """Through the command line, with a model path where there is no model: the settings are
    refused first (exit 2, the field and the fix), so nothing was read or trained."""
    data = write_jsonl(tmp_path / "d.jsonl", [])
    missing = tmp_path / "no-model"
    for extra, needle in [
        ("method.alpha=0", "method.alpha: must be >= 1 (LoRA scales its update by alpha / r"),
        ("method.target_modules=[]", "method.target_modules: an empty list adapts nothing"),
    ]:
        done = run_cli(tiny_train_args(missing, data, tmp_path / "run", extra))
        assert done.code == 2 and needle in done.err, done
    assert not (tmp_path / "run").exists()


LINEAR = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"


@pytest.mark.parametrize("method", ["lora", "ia3"])
@pytest.mark.parametrize(
    ("name", "what"),
    [("mlp", "a LlamaMLP"), ("input_layernorm", "a LlamaRMSNorm"), ("nothing_here", None)],
)
def test_target_names_that_are_not_linear_layers_name_the_ones_that_are(
    method: str, name: str, what: str | None
) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    with pytest.raises(MethodError) as err:
        apply_method(model, MethodConfig(name=method, target_modules=[name]))  # type: ignore[arg-type]
    message = str(err.value)
    assert message.startswith(f"method.target_modules: {name!r} ")
    assert f"the linear layers of its blocks are {LINEAR}" in message
    if what is not None:
        assert f"is {what}, not a linear" in message


def test_a_target_that_is_not_linear_is_refused_before_the_weights_load(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """The planner applies the method to the model built on the meta device from its config: a
    model directory without weights is refused for the targets, not for the missing weights."""
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    done = run_cli(
        tiny_train_args(
            model, data, tmp_path / "run", "method.name=ia3", "method.target_modules=[mlp]"
        )
    )
    assert done.code == 2, done
    assert "'mlp' is a LlamaMLP, not a linear layer" in done.err
    assert LINEAR in done.err


def test_every_lora_method_takes_the_same_checks() -> None:
    """The checks are the specs' own: a new LoRA-like method gets them from its spec."""
    for name, spec in METHODS.items():
        if spec.lora_settings:
            assert spec.check is not None, name
            assert "method.alpha" in (spec.check(MethodConfig(name=name, alpha=0)) or ""), name  # type: ignore[arg-type]


def test_ia3_takes_layer_names_not_all_linear(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [])
    with pytest.raises(ConfigError, match=r"all-linear stands alone .* and is LoRA's"):
        load_config(
            None, [f"data.train={data}", "method.name=ia3", "method.target_modules=[all-linear]"]
        )


def test_a_method_that_leaves_nothing_to_train_on_the_model_is_refused() -> None:
    """What only the model can tell: freeze with only the norms on a model whose norms have no
    weights (non-parametric, as OLMo's first version) trained nothing and "succeeded"."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    for name in [n for n, _ in model.named_modules() if n.endswith("norm")]:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, torch.nn.Identity())
    cfg = MethodConfig(name="freeze", last_blocks=0, norms=True)
    with pytest.raises(MethodError, match=r"method\.name=freeze leaves nothing to train on this"):
        apply_method(model, cfg)
