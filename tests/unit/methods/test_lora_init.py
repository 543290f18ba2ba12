"""method.init: how LoRA adapters start. LoftQ on a 4-bit base (qlora), and the refusals of the
initialisations that do not work on a method's base."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from support import QA_ROWS, run_cli, tiny_train_args, write_jsonl

from leantune.config import ConfigError
from leantune.config.roles import Role
from leantune.config.schema import field_roles
from leantune.methods import loftq
from leantune.methods.artifacts import load_for_inference
from leantune.methods.lora import quiet_peft
from leantune.methods.registry import (
    METHODS,
    apply_method,
    base_quantization,
    init_line,
    resolved_init,
)
from leantune.methods.spec import INIT_REPORT
from leantune.models.loading import ModelSource, load_model
from leantune.monitor.metrics import read_metrics
from leantune.testing.faults import SIGNAL_ENV
from leantune.training.checks import load_config
from leantune.training.run.fingerprint import trajectory_settings

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed"
)

IDS = torch.tensor([[5, 17, 42, 7, 99, 3, 11, 64], [8, 1, 77, 23, 5, 5, 90, 2]])


def wrapped(model_dir: Path, *overrides: str) -> torch.nn.Module:
    """The base loaded as the recipe loads it, wrapped by the configured method."""
    cfg = load_config(None, list(overrides))
    quant = base_quantization(cfg.method, "fp32")
    base = load_model(ModelSource(str(model_dir)), quantization=quant)
    torch.manual_seed(0)
    return apply_method(base, cfg.method).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_loftq_starts_closer_to_the_full_precision_base_than_default(
    tiny_llama_dir: Path,
) -> None:
    full = logits(load_model(ModelSource(str(tiny_llama_dir))).eval())
    four_bit = logits(load_model(ModelSource(str(tiny_llama_dir)), quantization=_nf4()).eval())
    default = logits(wrapped(tiny_llama_dir, "method.name=qlora", "method.init=default"))
    loftq = wrapped(tiny_llama_dir, "method.name=qlora", "method.init=loftq")
    # The default start (B = 0) is the 4-bit base itself.
    assert torch.equal(default, four_bit)
    gap_default = (default - full).abs().mean().item()
    gap_loftq = (logits(loftq) - full).abs().mean().item()
    # Measured on the tiny llama: 0.0132 -> 0.0077 (r=16 of layers 64-128 wide).
    assert gap_loftq < 0.75 * gap_default, (gap_loftq, gap_default)
    report = getattr(loftq, INIT_REPORT)
    assert report.layers == 14 and report.error_after < 0.9 * report.error_before, report
    line = init_line(loftq, load_config(None, ["method.name=qlora", "method.init=loftq"]).method)
    assert line is not None and line.startswith("LoRA initialisation: loftq (LoftQ start: 14")


def test_loftq_fit_counts_lora_scaling(tiny_llama_dir: Path) -> None:
    """scaling x B A is the rank-r SVD of W - NF4(W) whatever alpha / r is (peft's own
    replace_lora_weights_loftq leaves out the scaling): the error left is the residual's tail."""
    import bitsandbytes.functional as bnb_f

    fp = load_file(tiny_llama_dir / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    for alpha in (8, 64):
        model = wrapped(
            tiny_llama_dir, "method.name=qlora", "method.init=loftq", "method.r=4",
            f"method.alpha={alpha}",
        )  # fmt: skip
        layer = model.get_base_model().model.layers[1].mlp.down_proj
        q = layer.base_layer.weight
        residual = fp.float() - bnb_f.dequantize_4bit(q.data, q.quant_state)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        delta = layer.scaling["default"] * b @ a
        tail = torch.linalg.svdvals(residual)[4:].square().sum().sqrt()
        torch.testing.assert_close((residual - delta).norm(), tail, rtol=1e-4, atol=1e-6)


def test_default_init_is_logged_for_lora_methods_only(tiny_llama_dir: Path) -> None:
    cfg = load_config(None, ["method.name=lora", "method.init=default"])
    model = torch.nn.Linear(2, 2)
    assert init_line(model, cfg.method) == (
        "LoRA initialisation: default (B = 0: the model starts as its base)"
    )
    assert init_line(model, load_config(None, ["method.name=ia3"]).method) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["method.name=qlora", "method.init=pissa"],
            r"method\.init=pissa with method\.name=qlora: PiSSA .* a 4-bit base has no float "
            r"weights .*use method\.init=loftq",
        ),
        (
            ["method.name=qlora", "method.init=olora"],
            r"method\.init=olora with method\.name=qlora: peft's OLoRA re-quantises .*use "
            r"method\.init=loftq",
        ),
        (
            ["method.name=lora", "method.init=loftq"],
            r"method\.init=loftq with method\.name=lora: LoftQ .*use method\.name=qlora",
        ),
        (["method.name=dora", "method.init=loftq"], r"method\.init=loftq with method\.name=dora"),
        (
            ["method.name=lora", "method.init=pissa"],
            r"method\.init=pissa with method\.name=lora: not supported yet.*method\.init=default",
        ),
        (["method.name=lora", "method.init=olora"], r"method\.init=olora .*not supported yet"),
        (
            ["method.name=qlora", "method.init=loftq", "method.loftq_iter=3"],
            r"method\.loftq_iter=3: passes after the first re-quantise the base.*"
            r"use method\.loftq_iter=1",
        ),
        (
            ["method.name=qlora", "method.init=loftq", "method.loftq_iter=0"],
            r"method\.loftq_iter: must be >= 1, got 0",
        ),
        (
            ["method.name=qlora", "method.init=default", "method.loftq_iter=2"],
            r"method\.loftq_iter=2 is used only with method\.init=loftq",
        ),
        (
            ["method.name=ia3", "method.init=loftq"],
            r"method\.init and method\.loftq_iter set how LoRA adapters start \(lora, dora, "
            r"qlora\); method\.name=ia3 has none",
        ),
    ],
)
def test_inits_that_do_not_fit_the_base_are_refused_before_loading(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_loftq_with_qlora_validates() -> None:
    cfg = load_config(None, ["method.name=qlora", "method.init=loftq"])
    assert (cfg.method.init, cfg.method.loftq_iter) == ("loftq", 1)


def _nf4():  # the recipe's quantisation for qlora at fp32
    return base_quantization(load_config(None, ["method.name=qlora"]).method, "fp32")


def test_loftq_run_resumes_bit_exact_and_its_adapter_reloads(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoftQ run stopped by SIGTERM mid-step resumes to the uninterrupted run's losses and
    weights (the start is recomputed from the same files, then the checkpoint loads), logs its
    initialisation, and its final/ adapter reloads onto the re-quantised base as trained."""
    data = write_jsonl(tmp_path / "train.jsonl", QA_ROWS * 3)
    args = tiny_train_args(
        tiny_llama_dir, data, None,
        "method.name=qlora", "method.init=loftq", "method.dropout=0.1",
        "train.max_steps=4", "train.grad_accum=2", "train.save_every=0", "train.precision=fp32",
    )  # fmt: skip
    straight = run_cli([*args, f"run.dir={tmp_path / 'a'}"])
    assert straight.code == 0, straight
    assert "LoRA initialisation: loftq (LoftQ start: 14 4-bit layers" in straight.out
    monkeypatch.setenv(SIGNAL_ENV, "4:TERM")  # the first micro-batch of step 3
    stopped = run_cli([*args, f"run.dir={tmp_path / 'b'}"])
    assert stopped.code == 143 and "checkpoint" in stopped.err and "(step 2)" in stopped.err
    monkeypatch.delenv(SIGNAL_ENV)
    resumed = run_cli([*args, f"run.dir={tmp_path / 'b'}"])
    assert resumed.code == 0 and "step-000002 at step 2" in resumed.out, resumed
    a, b = (
        read_metrics(tmp_path / "a" / "metrics.jsonl"),
        read_metrics(tmp_path / "b" / "metrics.jsonl"),
    )
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    final = tmp_path / "a" / "final"
    wa = load_file(final / "adapter_model.safetensors")
    wb = load_file(tmp_path / "b" / "final" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # The base LoftQ started from is the one loading makes: the saved adapter needs nothing
    # more to be the trained model.
    reloaded, _ = load_for_inference(str(final))
    trained = wrapped(tiny_llama_dir, "method.name=qlora", "method.init=loftq")
    set_peft_model_state_dict(trained, wa)
    torch.testing.assert_close(logits(reloaded.eval()), logits(trained), rtol=0, atol=1e-6)


def test_the_init_fields_are_in_the_fingerprint_and_the_field_help() -> None:
    roles = field_roles()
    # Another start is another run: resume refuses the change even when forced.
    assert roles["method.init"] is Role.REFUSED and roles["method.loftq_iter"] is Role.SETTING
    listed = run_cli(["validate", "--help-fields"]).out
    assert '  method.init="auto"\n      How the LoRA adapters start.' in listed
    assert "  method.loftq_iter=1\n      method.init=loftq: passes" in listed


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_peft_pissa_and_olora_on_a_4bit_base_are_why_they_are_refused(
    init: str, tiny_llama_dir: Path
) -> None:
    """The refusals' reasons, pinned to peft's behaviour: PiSSA raises on a 4-bit weight, and
    OLoRA replaces the 4-bit base with NF4(W - BA), not the NF4(W) a saved adapter reloads on.
    A peft that changes either fails here, and the refusal should be revisited."""
    from peft import LoraConfig, get_peft_model

    base = load_model(ModelSource(str(tiny_llama_dir)), quantization=_nf4())
    before = base.model.layers[0].mlp.up_proj.weight.data.clone()
    config = LoraConfig(r=4, target_modules=["up_proj"], init_lora_weights=init)
    if init == "pissa":
        with quiet_peft(), pytest.raises(TypeError, match="PiSSA"):
            get_peft_model(base, config)
        return
    with quiet_peft():
        model = get_peft_model(base, config)
    after = model.get_base_model().model.layers[0].mlp.up_proj.base_layer.weight.data
    assert after.shape == before.shape and not torch.equal(after, before)


def test_init_auto_is_loftq_for_qlora_and_b0_for_the_others() -> None:
    """auto, the default: LoftQ beat B = 0 for qlora on both benchmark tasks (docs/guides/
    methods.md); the fingerprint records what auto resolved to, so a LoRA run recorded with
    init=default before auto existed resumes."""
    for name, spec in METHODS.items():
        cfg = load_config(None, [f"method.name={name}"])
        expected = "loftq" if name == "qlora" else "default"
        assert (cfg.method.init, resolved_init(cfg.method)) == ("auto", expected), name
        assert trajectory_settings(cfg)["method.init"] == expected, name
        assert spec.default_init == expected, name


def test_init_auto_wraps_qlora_as_loftq_and_logs_it(tiny_llama_dir: Path) -> None:
    auto = wrapped(tiny_llama_dir, "method.name=qlora")
    loftq = wrapped(tiny_llama_dir, "method.name=qlora", "method.init=loftq")
    assert torch.equal(logits(auto), logits(loftq))
    line = init_line(auto, load_config(None, ["method.name=qlora"]).method)
    assert line is not None and line.startswith(
        "LoRA initialisation: loftq (method.init=auto, qlora's default; LoftQ start: 14"
    ), line
    lora = load_config(None, ["method.name=lora"]).method
    assert init_line(torch.nn.Linear(2, 2), lora) == (
        "LoRA initialisation: default (method.init=auto, lora's default; B = 0: the model "
        "starts as its base)"
    )


def test_auto_keeps_the_default_start_where_loftq_cannot_read_the_base(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A base without safetensors (a GGUF file): auto trains with B = 0 and says why; LoftQ
    asked for by name still stops the run."""

    def no_files(model: torch.nn.Module) -> list[Path]:
        raise loftq.MethodError("method.init=loftq reads ...: found none for model.gguf")

    monkeypatch.setattr(loftq, "_base_shards", no_files)
    model = wrapped(tiny_llama_dir, "method.name=qlora")  # method.init=auto
    assert all(
        torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if "lora_B" in n
    )
    line = init_line(model, load_config(None, ["method.name=qlora"]).method)
    assert line == (
        "LoRA initialisation: default (method.init=auto, qlora's default; LoftQ skipped, B = 0 "
        "(the default start): found none for model.gguf)"
    )
    with pytest.raises(loftq.MethodError, match=r"found none for model\.gguf"):
        wrapped(tiny_llama_dir, "method.name=qlora", "method.init=loftq")


@pytest.mark.parametrize("spectrum", ["decaying", "flat"])
def test_the_randomized_fit_of_a_large_layer_is_within_1pct_of_the_exact_one(
    monkeypatch: pytest.MonkeyPatch, spectrum: str
) -> None:
    """Layers wider than EXACT_SVD_SIDE get the randomized SVD (a 7B's full SVDs take hours on
    a CPU); its rank-r fit leaves at most 1% more error than the exact SVD's, on a residual
    with a decaying spectrum and on a noise-like one (a quantisation error's)."""
    g = torch.Generator().manual_seed(0)
    residual = torch.randn(96, 400, generator=g)
    if spectrum == "decaying":
        residual = residual * torch.logspace(0, -2, 400)[None, :]
    exact_a, exact_b = loftq._rank_r_fit(residual, 8, 2.0)
    monkeypatch.setattr(loftq, "EXACT_SVD_SIDE", 32)
    fast_a, fast_b = loftq._rank_r_fit(residual, 8, 2.0)
    exact = (residual - 2.0 * exact_b @ exact_a).norm().item()
    fast = (residual - 2.0 * fast_b @ fast_a).norm().item()
    assert exact <= fast <= 1.01 * exact, (exact, fast)
    assert not torch.equal(fast_a, exact_a)  # the other path ran


def test_init_auto_resumes_the_start_a_run_recorded(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QLoRA run started with B = 0 (the default before auto) and stopped resumes with
    method.init=auto: auto keeps the recorded start, as train.precision=auto keeps the
    recorded precision, and says so; the losses are the uninterrupted B = 0 run's."""
    data = write_jsonl(tmp_path / "train.jsonl", QA_ROWS * 3)
    args = tiny_train_args(
        tiny_llama_dir, data, None,
        "method.name=qlora", "train.max_steps=4", "train.grad_accum=2", "train.save_every=0",
        "train.precision=fp32",
    )  # fmt: skip
    straight = run_cli([*args, "method.init=default", f"run.dir={tmp_path / 'a'}"])
    assert straight.code == 0, straight
    monkeypatch.setenv(SIGNAL_ENV, "4:TERM")  # the first micro-batch of step 3
    stopped = run_cli([*args, "method.init=default", f"run.dir={tmp_path / 'b'}"])
    assert stopped.code == 143 and "(step 2)" in stopped.err, stopped
    monkeypatch.delenv(SIGNAL_ENV)
    resumed = run_cli([*args, f"run.dir={tmp_path / 'b'}"])  # method.init=auto
    assert resumed.code == 0 and "step-000002 at step 2" in resumed.out, resumed
    assert (
        "method.init=auto: the resumed run keeps the start it recorded (default; auto picks "
        "loftq for a new qlora run)" in resumed.out
    ), resumed.out
    a, b = (
        read_metrics(tmp_path / "a" / "metrics.jsonl"),
        read_metrics(tmp_path / "b" / "metrics.jsonl"),
    )
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
