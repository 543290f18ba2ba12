"""What depends on the CPU's features: bitsandbytes' native CPU kernels and its import notice.

bitsandbytes' CPU library picks AVX512 code paths where the CPU has them and decides at import
whether to try an optional AVX512-BF16 kernel (`has_avx512bf16()`). The kernels leantune runs
(4-bit dequantisation for QLoRA and merging, 8-bit blockwise state for adamw_8bit) are checked
against a few lines of plain torch that compute the same thing, so whichever path this CPU takes
must give the portable result. The notice is checked with a forced record, so that an AVX2-only
CPU, where bitsandbytes never logs it, runs the same check.
"""

from __future__ import annotations

import importlib
import importlib.resources
import importlib.util
import json
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import tiny_train_args, write_jsonl

from leantune.models import bnb_import, bnb_notice
from leantune.models.quantize import keep_training_layout

NOTICE = (
    "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you "
    "already `pip install kernels` and the kernels >= 0.11.1"
)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bitsandbytes packs two 4-bit codes a byte, the first in the high nibble."""
    flat = packed.reshape(-1).to(torch.int64)
    return torch.stack([flat >> 4, flat & 0xF], dim=1).reshape(-1)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_native_4bit_dequantisation_equals_the_portable_formula(quant_type: str) -> None:
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    weight = torch.randn(256, 128)
    packed, state = bnb_f.quantize_4bit(weight, blocksize=64, quant_type=quant_type)
    native = bnb_f.dequantize_4bit(packed, state)
    code = bnb_f.get_4bit_type(quant_type, device="cpu")
    values = code[_unpack_nibbles(packed)].reshape(-1, 64) * state.absmax.view(-1, 1)
    torch.testing.assert_close(native, values.reshape(256, 128), rtol=0, atol=0)
    # And it is the weight: each value within half the widest gap between codes of its own.
    sorted_code = code.sort().values
    half_gap = float((sorted_code[1:] - sorted_code[:-1]).max()) / 2
    bound = (half_gap * state.absmax).repeat_interleave(64).reshape(256, 128) * (1 + 1e-6)
    assert bool(((native - weight).abs() <= bound).all())


def test_native_8bit_blockwise_state_equals_the_portable_formula() -> None:
    """adamw_8bit keeps its moments as 8-bit codes in blocks of 256 with one absmax each."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    state = torch.randn(4096) * 1e-3
    code = bnb_f.create_dynamic_map(signed=True)
    q, qs = bnb_f.quantize_blockwise(state, code=code, blocksize=256)
    native = bnb_f.dequantize_blockwise(q, qs)
    portable = (code[q.to(torch.int64)].view(-1, 256) * qs.absmax.view(-1, 1)).reshape(-1)
    torch.testing.assert_close(native, portable, rtol=0, atol=0)
    # The codes are the nearest ones: no value is further from its block's absmax-scaled
    # code than the widest gap between neighbouring codes.
    gap = float((code[1:] - code[:-1]).max())
    absmax = qs.absmax.repeat_interleave(256)
    assert bool(((native - state).abs() <= gap * absmax).all())


@pytest.fixture()
def held_notice() -> Iterator[bnb_notice._HeldNotice]:
    """A fresh filter on bitsandbytes' logger, as the CLI installs it at start-up."""
    fresh = bnb_notice._HeldNotice()
    old = bnb_notice._NOTICE
    bnb_notice._NOTICE = fresh
    logger = logging.getLogger(bnb_notice.BNB_CPU_LOGGER)
    logger.removeFilter(old)
    bnb_notice.hold_back_kernel_notice()
    yield fresh
    logger.removeFilter(fresh)
    bnb_notice._NOTICE = old
    logger.addFilter(old)


def _linear4bit() -> torch.nn.Module:
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(64, 32, compute_dtype=torch.float32, quant_type="nf4")
    return layer.to("cpu")


def test_the_kernel_notice_is_held_back_and_explained_once_when_4bit_is_in_use(
    held_notice: bnb_notice._HeldNotice,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What bitsandbytes logs at import on an AVX512-BF16 CPU without `kernels`, forced."""
    with caplog.at_level(logging.WARNING):
        logging.getLogger(bnb_notice.BNB_CPU_LOGGER).warning(NOTICE, "No module named 'kernels'")
    assert not [r for r in caplog.records if "gemm_4bit_forward" in r.getMessage()]
    assert capsys.readouterr().err == ""
    keep_training_layout(torch.nn.Sequential(torch.nn.Linear(4, 4)))  # fp32: nothing to say
    assert capsys.readouterr().err == ""
    assert keep_training_layout(torch.nn.Sequential(_linear4bit())) == 1
    err = capsys.readouterr().err
    assert err.count("note: bitsandbytes") == 1
    assert "(kernels-community/quantization-bitsandbytes: No module named 'kernels')" in err
    assert "its own kernel, the one training uses" in err and "nothing to do" in err
    assert "gemm_4bit_forward" not in err
    keep_training_layout(torch.nn.Sequential(_linear4bit()))  # once per process
    assert capsys.readouterr().err == ""


def test_the_explanation_keeps_the_reason_and_drops_advice_leantune_does_not_need(
    held_notice: bnb_notice._HeldNotice, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `kernels` installed (transformers 5.25 requires it) and the Hub offline, the reason
    bitsandbytes gives ends in advice to download the kernel: leantune never runs it."""
    offline = (
        "Version 1 of 'kernels-community/quantization-bitsandbytes' is not available in the local "
        "cache and Hugging Face Hub is in offline mode. Download the kernel while online first, "
        "or pass an explicit `revision=<commit>`."
    )
    logging.getLogger(bnb_notice.BNB_CPU_LOGGER).warning(NOTICE, offline)
    assert keep_training_layout(torch.nn.Sequential(_linear4bit())) == 1
    err = capsys.readouterr().err
    assert "is not available in the local cache and Hugging Face Hub is in offline mode)" in err
    assert "Download the kernel" not in err and "revision=" not in err
    assert "nothing to do" in err


def test_the_offline_trust_check_notice_of_kernels_is_dropped_and_nothing_else(
    held_notice: bnb_notice._HeldNotice, caplog: pytest.LogCaptureFixture
) -> None:
    """With the Hub offline (leantune's default), `kernels` logs that it skips its publisher
    check before it looks for bitsandbytes' kernel in the cache: a consequence of leantune's
    choice, not the user's, so it is dropped; its other messages are not."""
    logger = logging.getLogger(bnb_notice.KERNELS_HUB_LOGGER)
    with caplog.at_level(logging.WARNING):
        logger.warning(
            "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' "
            "because Hugging Face Hub is in offline mode."
        )
        logger.warning("Something else about a kernel.")
    assert [r.getMessage() for r in caplog.records] == ["Something else about a kernel."]


def test_without_the_notice_nothing_is_explained(
    held_notice: bnb_notice._HeldNotice, capsys: pytest.CaptureFixture[str]
) -> None:
    """AVX2-only CPUs, or `kernels` installed: bitsandbytes logs nothing, neither does leantune."""
    keep_training_layout(torch.nn.Sequential(_linear4bit()))
    assert capsys.readouterr().err == ""


# `python -m leantune ARGS`, then one line on stderr saying whether bitsandbytes was imported.
_REPORTING_BNB = """
import runpy, sys
sys.argv[0] = "leantune"
try:
    runpy.run_module("leantune", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print(f"bitsandbytes imported: {sys.modules.get('bitsandbytes') is not None}", file=sys.stderr)
sys.exit(code)
"""


# A stand-in for the `kernels` package, first on the path. bitsandbytes asks it for its optional
# kernel at import on AVX512-BF16 CPUs, and the real one (transformers 5.25 requires it and
# imports it too) asks the Hugging Face Hub: the stand-in becomes the real package where one is
# installed, with a get_kernel that says whether the Hub was offline when asked.
_KERNELS_STAND_IN = """
import importlib.machinery, importlib.util, os, sys


def get_kernel(repo_id, version=None, **kwargs):
    from huggingface_hub import constants

    raise RuntimeError(f"stand-in kernels, hub offline: {constants.HF_HUB_OFFLINE}")


_mine = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _mine]
_real = importlib.machinery.PathFinder.find_spec("kernels", _rest)
if _real is not None:
    sys.modules["kernels"] = _module = importlib.util.module_from_spec(_real)
    _real.loader.exec_module(_module)
    _module.get_kernel = get_kernel
"""


def test_train_imports_bitsandbytes_and_its_notice_only_for_4bit_and_explains_it(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Real processes, so that bitsandbytes is imported after the CLI starts, as for a user:
    LoRA's never imports it (peft would, and with it TorchDynamo and Inductor), QLoRA's does,
    with the Hub offline (leantune reaches it only with HF_HUB_OFFLINE=0), and explains the
    notice bitsandbytes logs on AVX512-BF16 CPUs when its optional kernel does not load."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import has_avx512bf16

    (tmp_path / "stand_in" / "kernels").mkdir(parents=True)
    (tmp_path / "stand_in" / "kernels" / "__init__.py").write_text(_KERNELS_STAND_IN)
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(4)
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LEANTUNE_HOME": str(tmp_path / "home")}
    env.pop("HF_HUB_OFFLINE", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path / "stand_in"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    printed = {}
    for method in ("lora", "qlora"):
        args = tiny_train_args(
            tiny_llama_dir,
            data,
            tmp_path / method,
            f"method.name={method}",
            "train.max_steps=1",
            "train.precision=fp32",
        )
        proc = subprocess.run(
            [sys.executable, "-c", _REPORTING_BNB, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed[method] = proc.stdout + proc.stderr
    for text in printed.values():
        assert "Failed to load CPU gemm_4bit_forward" not in text
    assert "bitsandbytes imported: False" in printed["lora"]
    assert "bitsandbytes imported: True" in printed["qlora"]
    assert "note: bitsandbytes" not in printed["lora"]
    assert printed["qlora"].count("note: bitsandbytes") == int(bool(has_avx512bf16()))
    assert ("stand-in kernels, hub offline: True" in printed["qlora"]) == bool(has_avx512bf16())
    assert "hub offline: False" not in printed["qlora"]


def test_a_package_imported_through_the_offline_finder_finds_the_hub_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `bnb_notice.import_offline` does for bitsandbytes, on a package of its own: the
    package and what it imports run with huggingface_hub offline, unless HF_HUB_OFFLINE=0;
    the flag is restored afterwards and the package is otherwise imported as usual."""
    from huggingface_hub import constants

    pkg = tmp_path / "offline_probe"
    pkg.mkdir()
    reads = "from huggingface_hub import constants\nOFFLINE = constants.HF_HUB_OFFLINE\n"
    (pkg / "__init__.py").write_text(reads + "from . import sub\n")
    (pkg / "sub.py").write_text(reads)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    bnb_notice.import_offline("offline_probe")
    bnb_notice.import_offline("offline_probe")  # once is enough
    finders = [f for f in sys.meta_path if isinstance(f, bnb_notice._OfflineImport)]
    assert [f.name for f in finders].count("offline_probe") == 1
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def fresh() -> types.ModuleType:
        for name in ("offline_probe", "offline_probe.sub"):
            sys.modules.pop(name, None)
        return importlib.import_module("offline_probe")

    module = fresh()
    assert module.OFFLINE is True and module.sub.OFFLINE is True
    assert constants.HF_HUB_OFFLINE is False
    assert module.__file__ == str(pkg / "__init__.py")
    assert importlib.resources.files(module).joinpath("sub.py").is_file()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the user allows downloads
    module = fresh()
    assert module.OFFLINE is False and module.sub.OFFLINE is False
    for name in ("offline_probe", "offline_probe.sub"):
        sys.modules.pop(name, None)


def _config_dir(path: Path, **extra: object) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **extra}))
    return str(path)


def test_a_run_needs_bitsandbytes_for_a_4bit_base_its_optimizers_or_an_unknown_model(
    tmp_path: Path,
) -> None:
    plain = _config_dir(tmp_path / "plain")
    quantised = _config_dir(tmp_path / "bnb", quantization_config={"quant_method": "bitsandbytes"})
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert not bnb_import.needed(False, "adamw", plain)
    assert not bnb_import.needed(False, "adamw_4bit", plain)  # torchao's
    assert not bnb_import.needed(False, "adamw", "smollm2-135m-instruct")  # the demo model
    assert not bnb_import.needed(False, "adamw", str(tmp_path / "model.Q4_1.gguf"))
    assert bnb_import.needed(True, "adamw", plain)  # qlora
    assert bnb_import.needed(False, "adamw_8bit", plain)
    assert bnb_import.needed(False, "paged_adamw_8bit", plain)
    assert bnb_import.needed(False, "adamw", quantised)
    assert bnb_import.needed(False, "adamw", str(adapter))  # its base is not known here
    assert bnb_import.needed(False, "adamw", str(tmp_path / "missing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert bnb_import.needed(False, "adamw", str(tmp_path / "bad"))


def test_a_held_back_bitsandbytes_reads_as_not_installed_to_peft_and_transformers() -> None:
    """In a fresh process: what peft and transformers see is a base install's view."""
    pytest.importorskip("bitsandbytes")
    code = """
import sys
from leantune.models import bnb_import
assert bnb_import.hold_back(True) is False and "bitsandbytes" not in sys.modules
assert bnb_import.hold_back(False) is True
import peft, transformers
from peft.import_utils import is_bnb_available
from transformers.utils import is_bitsandbytes_available
assert not is_bnb_available() and not is_bitsandbytes_available()
assert sys.modules["bitsandbytes"] is None and not hasattr(peft, "bnb")
print("ok")
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_an_imported_bitsandbytes_is_never_held_back(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = types.ModuleType("bitsandbytes")
    monkeypatch.setitem(sys.modules, "bitsandbytes", loaded)
    assert bnb_import.hold_back(False) is False and sys.modules["bitsandbytes"] is loaded
