"""The device, precision and process-group choices a CUDA machine makes, exercised on CPU with
fakes (`torch.cuda.is_available`, `set_device` and the process-group calls recorded, nothing
initialised), and the refusals a machine without CUDA gives before any work starts."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from support import make_config, run_cli, tiny_train_args

from leantune.training import resolve
from leantune.training.parallel import world as world_module
from leantune.training.parallel.ddp import DDPStrategy
from leantune.training.parallel.launch import EXPECTED_WORLD_ENV


def fake_cuda(monkeypatch: pytest.MonkeyPatch, available: bool, bf16: bool = True) -> None:
    """A machine with (or without) one 'Fake GPU', as torch.cuda reports it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if available else 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


class FakeDist:
    """Records the calls `init_world` makes, in order; initialises nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, torchrun: bool) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.kwargs: dict[str, Any] = {}
        dist = world_module.dist
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: self.calls.append(("set", i)))
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(dist, "init_process_group", self._init)
        monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
        monkeypatch.setattr(world_module, "launched_by_torchrun", lambda: torchrun)
        monkeypatch.setattr(world_module, "init_device_mesh", self._mesh)
        monkeypatch.setattr(world_module.atexit, "register", lambda f: None)

    def _init(self, backend: str, **kwargs: Any) -> None:
        self.calls.append(("init", backend))
        self.kwargs = kwargs

    def _mesh(self, device_type: str, shape: tuple[int, ...], **kwargs: Any) -> str:
        self.calls.append(("mesh", device_type))
        return f"mesh:{device_type}"


@pytest.mark.parametrize(
    ("backend", "device_type", "local_rank", "calls"),
    [
        # NCCL's communicator binds to the current device: set_device comes first.
        ("auto", "cuda", "3", [("set", 3), ("init", "nccl"), ("mesh", "cuda")]),
        ("auto", "cpu", "0", [("init", "gloo"), ("mesh", "cpu")]),
        ("gloo", "cuda", "1", [("set", 1), ("init", "gloo"), ("mesh", "cuda")]),
        ("nccl", "cuda", "0", [("set", 0), ("init", "nccl"), ("mesh", "cuda")]),
    ],
)
def test_init_world_picks_the_backend_and_binds_the_device_before_the_group(
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    device_type: str,
    local_rank: str,
    calls: list[tuple[str, Any]],
) -> None:
    fake = FakeDist(monkeypatch, torchrun=True)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.delenv(EXPECTED_WORLD_ENV, raising=False)
    w = world_module.init_world(backend, device_type, 7.0)
    assert fake.calls == calls
    assert fake.kwargs == {"timeout": datetime.timedelta(seconds=7.0)}  # env:// rendezvous
    expected = torch.device("cuda", int(local_rank)) if device_type == "cuda" else "cpu"
    assert w.device == torch.device(expected)
    assert (w.rank, w.world_size, w.local_rank) == (0, 1, int(local_rank))
    assert w.mesh == f"mesh:{device_type}"  # type: ignore[comparison-overlap]


def test_init_world_outside_torchrun_is_a_world_of_one_on_an_in_memory_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeDist(monkeypatch, torchrun=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    world_module.init_world("auto", "cuda", 5.0)
    assert fake.calls == [("set", 0), ("init", "nccl"), ("mesh", "cuda")]
    assert fake.kwargs["rank"] == 0 and fake.kwargs["world_size"] == 1
    assert isinstance(fake.kwargs["store"], torch.distributed.HashStore)


@pytest.mark.parametrize(
    ("available", "bf16", "device", "precision"),
    [(True, True, "cuda", "bf16"), (True, False, "cuda", "fp16"), (False, True, "cpu", None)],
)
def test_device_auto_takes_cuda_when_there_is_one_and_auto_precision_follows_it(
    tiny_llama_dir: Path,
    chat_files: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    available: bool,
    bf16: bool,
    device: str,
    precision: str | None,
) -> None:
    fake_cuda(monkeypatch, available, bf16)
    threads: list[bool] = []
    monkeypatch.setattr(resolve, "configure_threads", lambda: threads.append(True) or "threads")
    cfg = make_config(tiny_llama_dir, chat_files[0], tmp_path / "run")
    dev, resolved, notes = resolve.device_and_precision(cfg)
    assert dev == torch.device(device)
    assert threads == ([] if available else [True])  # CPU threads are a CPU run's business
    if precision is not None:  # on CPU, auto measures the CPU (tests/unit/core/test_precision)
        assert resolved.train.precision == precision
        assert any(n.startswith(f"train.precision=auto -> {precision}: Fake GPU") for n in notes)


def test_a_ddp_run_on_cuda_joins_an_nccl_group_bound_to_its_local_rank(
    tiny_llama_dir: Path,
    chat_files: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda(monkeypatch, True)
    fake = FakeDist(monkeypatch, torchrun=True)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv(EXPECTED_WORLD_ENV, "1")  # `leantune train --nproc 1`, as torchrun sets
    cfg = make_config(tiny_llama_dir, chat_files[0], tmp_path / "run", "dist.strategy=ddp")
    strategy = resolve.parallel_strategy(cfg)
    assert isinstance(strategy, DDPStrategy)
    assert fake.calls == [("set", 0), ("init", "nccl"), ("mesh", "cuda")]
    assert strategy.world.device == torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["train.precision=fp16"], "train.precision=fp16"),
        (["dist.strategy=ddp", "dist.backend=nccl"], "dist.backend=nccl"),
        (["train.device=cuda"], "train.device=cuda"),
    ],
)
def test_cuda_only_settings_on_a_machine_without_cuda_exit_2_before_any_work(
    tiny_llama_dir: Path,
    chat_files: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    overrides: list[str],
    says: str,
) -> None:
    # train.device=auto (the default) passes validation, which cannot know the machine: the
    # device resolution must refuse, not the scaler or the process group later on.
    fake_cuda(monkeypatch, False)
    run = tmp_path / "run"
    result = run_cli(tiny_train_args(tiny_llama_dir, chat_files[0], run, *overrides))
    assert result.code == 2, result
    assert says in result.err and "no CUDA device" in result.err
    assert "train.device=auto" in result.err  # the way on: auto (or cpu) trains here
    assert not (run / "prepared").exists()  # refused before the data was prepared
