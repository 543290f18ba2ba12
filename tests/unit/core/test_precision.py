"""train.precision=auto: bf16 where the device runs it fast, fp32 (CPU) or fp16 (CUDA) elsewhere.

The CPU choice comes from a measured probe, cached per machine; here the probe is replaced by a
stub that says "slow" (an AVX2-only CPU) or "fast" (AVX512-BF16/AMX), so both paths run on any
CPU. One test runs the real probe with oneDNN held to AVX2, which is what an AVX2-only CPU does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from support import run_cli, tiny_train_args, write_jsonl

from leantune.config import TrainConfig
from leantune.core import precision
from leantune.core.precision import (
    PROBE_FILE,
    PrecisionUnavailable,
    bf16_speed_on_cpu,
    resolve_precision,
)
from leantune.training.checks import check_config, load_config

SLOW, FAST = 45.0, 0.4
"""bf16 / fp32 matmul time on an AVX2-only CPU (emulated bf16) and on one with AMX."""
SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_MICRO_BATCH"


class Probe:
    """A stand-in for the ~0.1 s matmul probe that counts its calls."""

    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.slowdown


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty LEANTUNE_HOME, so that no cached measurement of this machine answers."""
    path = tmp_path / "home"
    monkeypatch.setenv("LEANTUNE_HOME", str(path))
    return path


def use_probe(monkeypatch: pytest.MonkeyPatch, slowdown: float) -> Probe:
    probe = Probe(slowdown)
    monkeypatch.setattr(precision, "bf16_slowdown_on_cpu", probe)
    return probe


def chat_file(tmp_path: Path, n: int = 12) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Order {i} for a lamp, status?"},
                {"role": "assistant", "content": json.dumps({"item": "lamp", "id": i})},
            ]
        }
        for i in range(n)
    ]
    return write_jsonl(tmp_path / "chat.jsonl", rows)


def test_auto_is_the_default_and_the_demo_uses_it() -> None:
    assert TrainConfig().precision == "auto"
    assert load_config(None, []).train.precision == "auto"  # the built-in demo config
    demo = Path(__file__).resolve().parents[3] / "src" / "leantune" / "configs" / "demo.yaml"
    assert yaml.safe_load(demo.read_text())["train"]["precision"] == "auto"


@pytest.mark.parametrize(
    ("slowdown", "expected", "says"),
    [
        (SLOW, "fp32", "bf16 matmul 45.0x slower than fp32 on this CPU"),
        (FAST, "bf16", "bf16 matmul 2.5x faster than fp32 on this CPU"),
        # Barely faster is not worth bf16's lower precision and the autocast casts.
        (0.9, "fp32", "bf16 pays off from 1.25x faster"),
    ],
)
def test_auto_on_cpu_follows_the_measured_bf16_speed(
    home: Path, monkeypatch: pytest.MonkeyPatch, slowdown: float, expected: str, says: str
) -> None:
    use_probe(monkeypatch, slowdown)
    choice = resolve_precision("auto", "cpu")
    assert choice.precision == expected
    assert choice.note is not None
    assert choice.note.startswith(f"train.precision=auto -> {expected}: ")
    assert says in choice.note
    assert f"measured now, cached in {home / PROBE_FILE}" in choice.note
    if slowdown == SLOW:
        assert "no native bf16 units" in choice.note


def test_the_probe_runs_once_per_machine_and_the_cache_answers_after(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = use_probe(monkeypatch, FAST)
    first = resolve_precision("auto", "cpu")
    probe.slowdown = SLOW  # a second measurement would now say fp32
    second = resolve_precision("auto", "cpu")
    assert probe.calls == 1
    assert first.precision == second.precision == "bf16"
    assert second.note is not None and "(measured 20" in second.note
    cached = json.loads((home / PROBE_FILE).read_text())
    (key,) = cached
    assert f"torch {torch.__version__}" in key and f"{torch.get_num_threads()} threads" in key
    assert cached[key]["bf16_slowdown"] == FAST
    # Another thread count is another measurement (bf16 and fp32 scale differently).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert resolve_precision("auto", "cpu").precision == "fp32"
    assert probe.calls == 2 and len(json.loads((home / PROBE_FILE).read_text())) == 2


def test_a_damaged_or_unwritable_cache_costs_only_the_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = use_probe(monkeypatch, SLOW)
    home = tmp_path / "home"
    home.mkdir()
    (home / PROBE_FILE).write_text("{not json")
    monkeypatch.setenv("LEANTUNE_HOME", str(home))
    assert bf16_speed_on_cpu().slowdown == SLOW
    assert json.loads((home / PROBE_FILE).read_text())  # rewritten whole
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("LEANTUNE_HOME", str(blocked / "home"))  # cannot be created
    speed = bf16_speed_on_cpu()
    assert speed.slowdown == SLOW and speed.cached_in is None and probe.calls == 2
    assert "cached" not in speed.describe()


def test_explicit_bf16_on_a_cpu_that_emulates_it_warns(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_probe(monkeypatch, SLOW)
    choice = resolve_precision("bf16", "cpu")
    assert choice.precision == "bf16"
    assert choice.note is not None and choice.note.startswith("warning: train.precision=bf16")
    assert "45x slower" in choice.note
    assert resolve_precision("fp32", "cpu").note is None


@pytest.mark.parametrize(
    ("bf16_supported", "compute_dtype", "expected", "says"),
    [
        (True, "auto", "bf16", "Fake GPU supports bf16"),
        (False, "auto", "fp16", "Fake GPU has no bf16 support; fp16 autocast with a GradScaler"),
        (True, "fp16", "fp16", "method.compute_dtype=fp16"),
    ],
)
def test_auto_on_cuda_takes_bf16_where_supported_else_fp16_with_a_scaler(
    monkeypatch: pytest.MonkeyPatch,
    bf16_supported: bool,
    compute_dtype: str,
    expected: str,
    says: str,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Fake GPU")
    monkeypatch.setattr(precision, "bf16_slowdown_on_cpu", Probe(1.0))  # never asked on CUDA
    choice = resolve_precision("auto", "cuda", compute_dtype=compute_dtype)
    assert choice.precision == expected
    assert choice.note is not None and says in choice.note
    assert precision.bf16_slowdown_on_cpu.calls == 0  # type: ignore[attr-defined]


def test_auto_never_picks_what_validation_refuses_with_the_qlora_compute_dtype(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_probe(monkeypatch, FAST)
    # bf16 autocast around fp16 4-bit matmuls is refused; fp16 autocast needs CUDA.
    assert resolve_precision("auto", "cpu", compute_dtype="fp16").precision == "fp32"


def test_a_resumed_fp16_run_on_a_machine_without_cuda_is_explained() -> None:
    with pytest.raises(PrecisionUnavailable, match=r"started in fp16.*run\.resume=force"):
        resolve_precision("auto", "cpu", recorded="fp16")
    assert PrecisionUnavailable.exit_code == 2


@pytest.mark.parametrize(("slowdown", "expected"), [(SLOW, "fp32"), (FAST, "bf16")])
def test_the_run_logs_its_choice_and_records_the_resolved_precision(
    tiny_llama_dir: Path,
    tmp_path: Path,
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    slowdown: float,
    expected: str,
) -> None:
    use_probe(monkeypatch, slowdown)
    run = tmp_path / "run"
    result = run_cli(tiny_train_args(tiny_llama_dir, chat_file(tmp_path), run, "train.max_steps=1"))
    assert result.code == 0, result.err
    lines = [ln for ln in result.out.splitlines() if ln.startswith("train.precision=auto")]
    assert len(lines) == 1 and lines[0].startswith(f"train.precision=auto -> {expected}: bf16")
    record = json.loads((run / "leantune_run.json").read_text())
    assert record["fingerprint"]["train.precision"] == expected
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["precision"] == expected


def test_a_resumed_auto_run_keeps_its_precision_on_a_machine_that_would_choose_another(
    tiny_llama_dir: Path, tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started where bf16 is fast, interrupted, resumed where it is slow: it goes on in bf16,
    and ends with the same weights as the same run uninterrupted."""
    data = chat_file(tmp_path)
    steps = ("train.max_steps=4", "train.save_every=2", "train.seed=3")
    probe = use_probe(monkeypatch, FAST)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run_cli(tiny_train_args(tiny_llama_dir, data, whole, *steps)).code == 0
    monkeypatch.setenv(SIGNAL_ENV, "1:TERM")  # after step 2, with its checkpoint
    assert run_cli(tiny_train_args(tiny_llama_dir, data, cut, *steps)).code == 143
    monkeypatch.delenv(SIGNAL_ENV)
    (home / PROBE_FILE).unlink()  # "another machine": measured again, and bf16 is slow there
    probe.slowdown = SLOW
    result = run_cli(tiny_train_args(tiny_llama_dir, data, cut, *steps))
    assert result.code == 0, result.err
    assert "resumed from" in result.out
    assert "train.precision=auto -> bf16: the precision the resumed run started with" in result.out
    assert "warning: train.precision=bf16: bf16 matmul is 45x slower" in result.out
    record = json.loads((cut / "leantune_run.json").read_text())
    assert record["fingerprint"]["train.precision"] == "bf16"
    a = load_file(whole / "final" / "adapter_model.safetensors")
    b = load_file(cut / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Starting over decides afresh, on this machine.
    again = run_cli(tiny_train_args(tiny_llama_dir, data, cut, *steps, "run.resume=never"))
    assert again.code == 0 and "train.precision=auto -> fp32" in again.out


def test_an_fp16_run_resumed_on_cpu_exits_2_naming_the_way_on(
    tiny_llama_dir: Path, tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_probe(monkeypatch, SLOW)
    data, run = chat_file(tmp_path), tmp_path / "run"
    args = tiny_train_args(tiny_llama_dir, data, run, "train.max_steps=2", "train.save_every=1")
    assert run_cli(args).code == 0
    record_file = run / "leantune_run.json"
    record = json.loads(record_file.read_text())
    record["fingerprint"]["train.precision"] = "fp16"  # as a CUDA machine records it
    record_file.write_text(json.dumps(record))
    result = run_cli(args)
    assert result.code == 2
    assert "started in fp16" in result.err and "run.resume=force" in result.err


@pytest.mark.parametrize(("slowdown", "compute"), [(SLOW, "fp32"), (FAST, "bf16")])
def test_qlora_compute_dtype_auto_follows_the_resolved_precision(
    tiny_llama_dir: Path,
    tmp_path: Path,
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    slowdown: float,
    compute: str,
) -> None:
    pytest.importorskip("bitsandbytes")
    use_probe(monkeypatch, slowdown)
    run = tmp_path / "run"
    args = tiny_train_args(
        tiny_llama_dir, chat_file(tmp_path), run, "method.name=qlora", "train.max_steps=1"
    )
    assert run_cli(args).code == 0
    pointer = json.loads((run / "final" / "leantune_base.json").read_text())
    assert pointer["quantization"]["compute_dtype"] == compute


@pytest.mark.parametrize(("slowdown", "expected"), [(SLOW, "fp32"), (FAST, "bf16")])
def test_the_memory_planner_plans_with_the_resolved_precision(
    tiny_llama_dir: Path,
    tmp_path: Path,
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    slowdown: float,
    expected: str,
) -> None:
    from leantune.memory.inputs import plan_basis
    from leantune.training.plan_report import format_text, plan
    from leantune.training.planning import plan_inputs

    use_probe(monkeypatch, slowdown)
    data = chat_file(tmp_path)
    cfg = load_config(None, [f"model.path={tiny_llama_dir}", f"data.train={data}"])
    cfg.train.precision = "auto"  # as the default and the demo config have it
    assert plan_basis(plan_inputs(cfg), "cpu").step.precision == expected
    assert f"precision {expected}" in format_text(plan(cfg, "cpu"))
    # Planning for a GPU from a machine without one: bf16 or fp16 take the same memory.
    if not torch.cuda.is_available():
        assert plan_basis(plan_inputs(cfg), "cuda").step.precision == "bf16"


@pytest.mark.parametrize(("slowdown", "warns"), [(SLOW, True), (FAST, False)])
def test_set_up_warns_about_bf16_4bit_matmuls_only_where_bf16_is_emulated(
    home: Path, monkeypatch: pytest.MonkeyPatch, slowdown: float, warns: bool
) -> None:
    """The warning comes with the precision the run resolves at set-up; validating the config
    measures nothing (it does not run the matmul probe)."""
    probe = use_probe(monkeypatch, slowdown)
    cfg = load_config(None, ["method.name=qlora", "method.compute_dtype=bf16", "train.device=cpu"])
    assert not [w for w in check_config(cfg) if "method.compute_dtype=bf16" in w]
    assert probe.calls == 0
    note = resolve_precision("fp32", "cpu", None, cfg.method.compute_dtype).note or ""
    warned = [line for line in note.splitlines() if "method.compute_dtype=bf16" in line]
    assert bool(warned) == warns
    if warns:
        assert "45.0x slower" in warned[0] and "fp32 is faster" in warned[0]


def test_the_real_probe_finds_bf16_slow_when_onednn_is_held_to_avx2(tmp_path: Path) -> None:
    """An AVX2-only CPU has no bf16 matmul units: oneDNN emulates bf16 there. Holding oneDNN
    (and torch's own kernels) to AVX2 reproduces that on any x86 CPU, so the real probe and the
    choice are checked on the AVX2 path here too. Measured on an AMX Xeon: bf16 45x slower held
    to AVX2 (2.4 vs 110 GFLOP/s), 4x faster natively; the check only needs "not faster"."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("ONEDNN_MAX_CPU_ISA=AVX2 is an x86 setting")
    code = (
        "from leantune.core.precision import resolve_precision\n"
        "c = resolve_precision('auto', 'cpu')\n"
        "print(c.precision)\nprint(c.note)\n"
    )
    env = {
        **os.environ,
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "LEANTUNE_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    chosen, note = proc.stdout.splitlines()[:2]
    assert chosen == "fp32", note
    assert "slower than fp32 on this CPU" in note
