"""Every metrics record's padding, MFU, data wait, ETA, CPU and GPU fields: the arithmetic
against hand-computed values, and a tiny run's records against its own data."""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from support import chat_rows, make_config, write_jsonl
from transformers import AutoModelForCausalLM

from leantune.config import MethodConfig
from leantune.data.loader import collate
from leantune.methods.registry import apply_method
from leantune.monitor import gpu
from leantune.monitor.flops import flops_per_token, matmul_parameters, measure_peak_flops
from leantune.monitor.metrics import read_metrics
from leantune.monitor.step_stats import StepStats, build_step_stats
from leantune.training import recipe, trainer


def test_flops_per_token_is_6n_for_full_and_4n_plus_2n_trainable_for_lora(
    tiny_qwen2_dir: Path,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)  # untied output head
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    n, trainable = matmul_parameters(model)
    assert (n, trainable) == (total - embedding, total - embedding)  # untied: a lookup
    assert flops_per_token(n, trainable) == 6 * n
    lora = apply_method(model, MethodConfig(name="lora", r=4))
    n_lora, t_lora = matmul_parameters(lora)
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert t_lora == adapters and n_lora == n + adapters
    assert flops_per_token(n_lora, t_lora) == 4 * n + 6 * adapters


def test_a_tied_embedding_counts_as_the_output_head(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert matmul_parameters(model)[0] == sum(p.numel() for p in model.parameters())


def test_the_peak_probe_measures_a_plausible_rate_and_leaves_the_rng_alone() -> None:
    rng = torch.get_rng_state()
    start = time.perf_counter()
    peak = measure_peak_flops(torch.device("cpu"), "fp32")
    took = time.perf_counter() - start
    # Its size follows its timing, so drawing from the run's RNG would change the run.
    assert torch.equal(torch.get_rng_state(), rng)
    assert peak is not None and 1e8 < peak < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s on a CPU
    assert took < 5  # ~50 ms unloaded; generous for a loaded CI machine


def test_stats_fields_from_known_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = StepStats(flops_per_token=600.0, peak_flops=1e6, max_steps=10, cores=4)
    clock = iter([100.0, 102.0, 102.0, 102.0])  # the process's CPU seconds at each reading
    monkeypatch.setattr("leantune.monitor.step_stats._cpu_seconds", lambda: next(clock))
    stats.begin()
    with stats.data:
        time.sleep(0.01)
    stats._wall_start = time.perf_counter() - 1.0  # the step took 1 s of wall time
    row = stats.fields(step=4, tokens=750, elements=1000, elapsed=1.0)
    assert row["pad_tokens"] == 250 and row["padding_ratio"] == 0.25
    assert row["mfu"] == pytest.approx(600 * 750 / 1.0 / 1e6)
    assert 0.01 <= row["data_wait_s"] < 0.5 and row["data_wait_ratio"] == row["data_wait_s"]
    assert row["eta_s"] == pytest.approx(6 * 1.0)  # 6 steps left at 1 s
    assert row["cpu_utilization"] == pytest.approx(2.0 / 1.0 / 4, rel=1e-3)  # 2 of 4 cores
    assert row["rss_bytes"] > 0
    stats.begin()  # the data clock restarts with every step
    assert stats.data.seconds == 0.0
    later = stats.fields(step=5, tokens=10, elements=10, elapsed=3.0)
    assert later["eta_s"] == pytest.approx(5 * (1.0 + 3.0) / 2)  # the mean of the steps seen
    assert later["padding_ratio"] == 0.0


def test_no_peak_means_no_mfu_and_no_steps_means_no_eta() -> None:
    stats = StepStats()
    stats.begin()
    row = stats.fields(1, 10, 20, 0.5)
    assert row["mfu"] is None and row["eta_s"] is None and "gpu_utilization" not in row


class FakeNvml(types.ModuleType):
    """pynvml as nvidia-ml-py provides it, for a machine with one GPU."""

    def __init__(self, fail_reads: bool = False) -> None:
        super().__init__("pynvml")
        self.fail_reads = fail_reads
        self.asked: list[tuple[str, Any]] = []

    def nvmlInit(self) -> None:
        self.asked.append(("init", None))

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.asked.append(("uuid", uuid))
        return "handle-0"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.asked.append(("index", index))
        return f"handle-{index}"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        if self.fail_reads:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return types.SimpleNamespace(gpu=37, memory=12)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return types.SimpleNamespace(used=5 * 2**30, total=80 * 2**30, free=75 * 2**30)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, uuid: str | None) -> None:
    props = types.SimpleNamespace(name="Fake GPU")
    if uuid is not None:
        props.uuid = uuid  # type: ignore[attr-defined]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)


def test_nvml_reads_the_gpu_found_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    fake_cuda(monkeypatch, "8f0c2a6e-0000-1111-2222-333344445555")
    probe = gpu.open_gpu_probe(torch.device("cuda"))
    assert probe is not None
    assert nvml.asked == [("init", None), ("uuid", "GPU-8f0c2a6e-0000-1111-2222-333344445555")]
    assert probe.read() == {"gpu_utilization": 0.37, "gpu_memory_used_bytes": 5 * 2**30}
    stats = StepStats(gpu=probe)
    stats.begin()
    row = stats.fields(1, 1, 1, 1.0)
    assert row["gpu_utilization"] == 0.37 and row["gpu_memory_used_bytes"] == 5 * 2**30


def test_nvml_falls_back_to_the_index_and_never_fails_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = FakeNvml(fail_reads=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    fake_cuda(monkeypatch, None)
    probe = gpu.open_gpu_probe(torch.device("cuda:0"))
    assert probe is not None and ("index", 0) in nvml.asked
    assert probe.read() == {}  # a lost GPU: no figures, no error


def test_no_nvml_off_cuda_or_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    assert gpu.open_gpu_probe(torch.device("cpu")) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    fake_cuda(monkeypatch, "x")
    assert gpu.open_gpu_probe(torch.device("cuda")) is None


def test_build_step_stats_logs_the_peak_and_counts_the_wrapped_model(
    tiny_llama_dir: Path,
) -> None:
    model = apply_method(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir), MethodConfig(name="lora", r=4)
    )
    lines: list[str] = []
    stats = build_step_stats(
        model, torch.device("cpu"), "fp32", 7, lines.append, measure=lambda d, p: 2e12
    )
    n, trainable = matmul_parameters(model)
    assert stats.flops_per_token == 4 * n + 2 * trainable and stats.peak_flops == 2e12
    assert stats.max_steps == 7 and stats.gpu is None and not stats.rss
    assert lines == ["MFU is measured against a fp32 matmul peak of 2 TFLOP/s"]


def test_a_runs_records_hold_padding_mfu_eta_and_resources(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collated: list[tuple[int, int]] = []  # (non-pad tokens, tensor elements) of each micro-batch

    def spy(rows: list[Any], pad_id: int) -> dict[str, torch.Tensor]:
        batch = collate(rows, pad_id)
        collated.append((sum(len(r.input_ids) for r in rows), batch["input_ids"].numel()))
        return batch

    monkeypatch.setattr(trainer, "collate", spy)
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(12))
    run = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir, train_file, run, "data.pack=false", "train.max_steps=3",
        "train.grad_accum=2",
    )  # fmt: skip
    recipe.train(cfg, log=lambda _: None)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and len(collated) == 6  # 2 micro-batches each
    for k, r in enumerate(rows):
        tokens = collated[2 * k][0] + collated[2 * k + 1][0]
        elements = collated[2 * k][1] + collated[2 * k + 1][1]
        assert r["tokens"] == tokens
        assert r["pad_tokens"] == elements - tokens
        assert r["padding_ratio"] == (elements - tokens) / elements
        assert 0 < r["mfu"] < 1
        assert 0 <= r["data_wait_ratio"] < 1 and r["data_wait_s"] < r["step_time_s"]
        assert 0 < r["cpu_utilization"] <= 1 and r["rss_bytes"] > 0
    assert any(r["padding_ratio"] > 0 for r in rows)  # unpacked rows of different lengths
    times = [r["step_time_s"] for r in rows]
    assert rows[0]["eta_s"] == pytest.approx(2 * times[0])
    assert rows[1]["eta_s"] == pytest.approx((times[0] + times[1]) / 2)
    assert rows[2]["eta_s"] == 0


def test_mfu_never_exceeds_one_and_says_so_once() -> None:
    """A peak probed under load reads low (an MFU above 1 would follow): a step
    faster than it raises the peak to the observed rate, said once."""
    lines: list[str] = []
    stats = StepStats(flops_per_token=1e6, peak_flops=1e9, max_steps=10, log=lines.append)
    stats.begin()
    assert stats.fields(step=1, tokens=5_000, elements=5_000, elapsed=1.0)["mfu"] == 1.0
    assert stats.peak_flops == 5e9 and len(lines) == 1 and "above the matmul peak" in lines[0]
    assert stats.fields(step=2, tokens=6_000, elements=6_000, elapsed=1.0)["mfu"] == 1.0
    assert len(lines) == 1  # once per run
    assert stats.fields(step=3, tokens=3_000, elements=3_000, elapsed=1.0)["mfu"] == 0.5


def test_the_peak_is_the_best_of_the_cached_and_the_current_probe(tmp_path: Path) -> None:
    from leantune.monitor.flops import best_peak_flops

    cache, cpu = tmp_path / "peak.json", torch.device("cpu")
    assert best_peak_flops(cpu, "fp32", lambda d, p: 2e11, cache) == 2e11
    assert best_peak_flops(cpu, "fp32", lambda d, p: 5e10, cache) == 2e11  # probed under load
    assert best_peak_flops(cpu, "bf16", lambda d, p: 5e10, cache) == 5e10  # its own entry
    assert best_peak_flops(cpu, "fp32", lambda d, p: 3e11, cache) == 3e11
    assert best_peak_flops(cpu, "fp32", lambda d, p: None, cache) == 3e11
    cache.write_text("not json")
    assert best_peak_flops(cpu, "fp32", lambda d, p: 1e11, cache) == 1e11
