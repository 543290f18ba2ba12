"""benchmarks/step_profile.py: a profiled LoRA update of a tiny model is split into buckets
that add up to the update's wall time, with the matmul FLOPs its shapes imply."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "step_profile.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_matmul_flops_read_the_shapes_of_mm_addmm_and_bmm() -> None:
    sp = _script()
    assert sp.matmul_flops("aten::mm", [[7, 64], [64, 3]]) == (2 * 7 * 64 * 3, (7, 64, 3))
    # addmm's bias comes first and is not a factor.
    flops, dims = sp.matmul_flops("aten::addmm", [[32], [7, 64], [64, 32]])
    assert (flops, dims) == (2 * 7 * 64 * 32, (7, 64, 32))
    assert sp.matmul_flops("aten::bmm", [[2, 5, 6], [2, 6, 4]])[0] == 2 * 2 * 5 * 6 * 4
    assert sp.matmul_bucket((7, 64, 3), 3) == "LoRA matmuls"
    assert sp.matmul_bucket((7, 64, 32), 3) == "base matmuls"


def test_the_buckets_of_a_profiled_lora_update_add_up_to_its_wall_time(
    tiny_qwen2_dir: Path, chat_files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    sp = _script()
    train, _ = chat_files
    # Rank 3: no dimension of the tiny model, so a rank-3 product is LoRA's and nothing else.
    line = sp.main(
        [
            "--model-path", str(tiny_qwen2_dir), "--train", str(train), "--precision", "bf16",
            "--warmup", "1", "--steps", "2", "--peak-seconds", "0.05",
            "method.r=3", "method.alpha=6", "data.max_seq_len=128", "train.micro_batch_size=2",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith('{"benchmark": "step_profile"')
    buckets = line["buckets_ms"]
    assert set(buckets) == set(sp.BUCKETS)
    # Every bucket is a share of the update: none negative (the time outside any op would be,
    # if an op's time were counted twice), and together they are the update's wall time.
    assert min(buckets.values()) >= 0.0, buckets
    assert sum(buckets.values()) == pytest.approx(line["step_ms"], rel=0.01)
    assert sum(line["buckets_pct"].values()) == pytest.approx(100.0, abs=1.0)
    # The work the update must have done is where it belongs.
    for name in ("base matmuls", "LoRA matmuls", "chunked loss", "attention", "optimizer"):
        assert buckets[name] > 0.0, name
    by = line["matmul_gflop_by_bucket"]
    assert by["LoRA matmuls"] > 0 and by["base matmuls"] > by["LoRA matmuls"]
    # "all" is every mm/bmm: the short-segment attention kernel's too (bf16 on CPU), not the
    # flash kernels' (no mm events; their FLOPs are counted from shapes into "attention").
    parts = ("base matmuls", "LoRA matmuls", "other matmuls", "loss", "attention matmuls")
    assert by["all"] == pytest.approx(sum(by[k] for k in parts), abs=0.002)
    assert by["attention"] >= by["attention matmuls"]
    assert line["casts_per_step"] > 0
    assert line["peak_gflops"] > 0 and line["matmul_gflops"] > 0
    assert len(line["losses"]) == 3
