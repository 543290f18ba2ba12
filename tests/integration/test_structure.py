"""The code's shape, checked: small functions and files, components that never see the
config, and a loop that reaches its sinks and its parallel strategy only through their
protocols."""

from __future__ import annotations

import ast
import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support import chat_rows, make_config, write_jsonl
from torch import nn

from leantune.monitor.events import read_events
from leantune.monitor.metrics import read_metrics
from leantune.monitor.sinks import Sinks
from leantune.testing.faults import LOSS_SCALE_ENV
from leantune.training import recipe, run_monitoring
from leantune.training.parallel.parts import CheckpointParts, SyncScope
from leantune.training.parallel.strategy import SingleProcess
from leantune.training.state.checkpoint import Checkpoint

SRC = Path(__file__).resolve().parents[2] / "src" / "leantune"


def _functions(path: Path) -> Iterator[tuple[str, int]]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_over_80_lines_and_no_file_over_600() -> None:
    """The budgets: 600 lines leaves room below STYLE.md's ~800, so that a file grows
    into a split by responsibility instead of being cut at the cap."""
    long_functions = [
        f"{p.relative_to(SRC)}:{name} ({n} lines)"
        for p in sorted(SRC.rglob("*.py"))
        for name, n in _functions(p)
        if n > 80
    ]
    long_files = [
        f"{p.relative_to(SRC)} ({n} lines)"
        for p in sorted(SRC.rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600
    ]
    assert long_functions == [] and long_files == []


@pytest.mark.parametrize(
    "module",
    [
        "training/trainer.py",
        "training/hooks.py",
        "monitor/sinks.py",
        "training/parallel/strategy.py",
        "training/guard/actions.py",
        "training/guard/detect.py",
        "training/evaluation.py",
    ],
)
def test_loop_components_never_see_the_config(module: str) -> None:
    tree = ast.parse((SRC / module).read_text(encoding="utf-8"))
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not {m for m in imported if m == "leantune.config" or m.startswith("leantune.config.")}


class RecordingSink:
    """A sink as a monitoring backend would be: it sees every record the loop emits."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start(self, step: int) -> None:
        self.calls.append(("start", step))

    def metrics(self, record: dict[str, Any]) -> None:
        self.calls.append(("metrics", record))

    def eval(self, row: dict[str, Any]) -> None:
        self.calls.append(("eval", row))

    def event(self, event: dict[str, Any]) -> None:
        self.calls.append(("event", event))

    def close(self) -> None:
        self.calls.append(("close", None))


def test_a_sink_sees_every_record_the_run_files_hold_and_the_rollback(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(24))
    eval_file = write_jsonl(tmp_path / "eval.jsonl", chat_rows(4, offset=100))
    sink = RecordingSink()
    built = run_monitoring.sinks_for

    def with_recorder(*args: Any, **kwargs: Any) -> Sinks:
        sinks = built(*args, **kwargs)
        return Sinks([*sinks.sinks, sink])

    monkeypatch.setattr(run_monitoring, "sinks_for", with_recorder)
    monkeypatch.setenv(LOSS_SCALE_ENV, "6:50")  # step 6's loss x50: a spike, rolled back
    run = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir, train_file, run, "data.pack=false", "train.max_steps=8",
        "train.save_every=2", "train.lr=1e-3", "guard.loss_spike=rollback", "guard.warmup=3",
        f"data.eval={eval_file}", "train.eval_every=4",
    )  # fmt: skip
    recipe.train(cfg, log=lambda _: None)

    kinds = [k for k, _ in sink.calls]
    assert kinds[0] == "start" and kinds[-1] == "close" and kinds.count("close") == 1
    starts = [v for k, v in sink.calls if k == "start"]
    assert starts == [0, 4]  # the start, and the rollback to the step-4 checkpoint
    seen = [v for k, v in sink.calls if k == "metrics"]
    assert [r["step"] for r in seen] == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    # After the rollback metrics.jsonl holds one trajectory: the sink's last record per step.
    last = {r["step"]: r for r in seen}
    assert read_metrics(run / "metrics.jsonl") == [last[s] for s in sorted(last)]
    evals = [v for k, v in sink.calls if k == "eval"]
    assert read_metrics(run / "eval.jsonl") == [evals[0], evals[-1]] and len(evals) == 2
    events = [v for k, v in sink.calls if k == "event"]
    assert events == read_events(run / "events.jsonl")
    assert [e["kind"] for e in events] == ["loss_spike", "rollback"]


class RecordingStrategy(SingleProcess):
    """The trivial strategy, recording what the loop asks of it."""

    def __init__(self) -> None:
        self.wrapped: list[nn.Module] = []
        self.windows: list[list[int]] = []
        self.counts: list[int] = []
        self.syncs: list[bool] = []
        self.saved = 0
        self.loaded = 0
        self.agreements = 0
        self.finals = 0

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.wrapped.append(model)
        return model

    def shard_window(self, window: list[int]) -> list[int]:
        self.windows.append(list(window))
        return window

    def reduce_count(self, count: int) -> int:
        self.counts.append(count)
        return count

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[SyncScope]:
        self.syncs.append(enabled)
        yield SyncScope()

    def agree(self, code: int) -> int:
        self.agreements += 1
        return code

    def save_checkpoint(self, root: Path, parts: CheckpointParts) -> Path:
        self.saved += 1
        return super().save_checkpoint(root, parts)

    def load_checkpoint(
        self, ckpt: Checkpoint, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
    ) -> None:
        self.loaded += 1
        super().load_checkpoint(ckpt, params, optimizer)

    def final_model(self, model: nn.Module, rebuild: Callable[[], nn.Module]) -> nn.Module | None:
        self.finals += 1
        return model


def test_the_loop_reaches_the_strategy_for_each_of_its_duties(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(24))
    common = ("data.pack=false", "train.micro_batch_size=2", "train.grad_accum=3",
              "train.save_every=2", "train.precision=fp32")  # fmt: skip
    recipe.train(
        make_config(tiny_llama_dir, train_file, tmp_path / "a", *common), log=lambda _: None
    )
    strategy = RecordingStrategy()
    monkeypatch.setattr(recipe, "parallel_strategy", lambda cfg: strategy)
    recipe.train(
        make_config(tiny_llama_dir, train_file, tmp_path / "b", *common), log=lambda _: None
    )

    assert len(strategy.wrapped) == 1
    assert len(strategy.windows) == 4 and all(len(w) == 6 for w in strategy.windows)
    assert len(strategy.counts) == 4  # one reduction of the supervised tokens per window
    assert strategy.syncs == [False, False, True] * 4  # sync on each window's last micro-batch
    assert strategy.saved == 2 and strategy.loaded == 0  # steps 2 and 4
    # Two decisions per micro-batch (after its forward, after its backward), one per step (a
    # loss or gradient not finite), and four of the set-up (run directory claimed, data
    # prepared, read before written, step-0 save or not).
    assert strategy.agreements == 2 * 12 + 4 + 4 and strategy.finals == 1
    wa = load_file(tmp_path / "a" / "final" / "adapter_model.safetensors")
    wb = load_file(tmp_path / "b" / "final" / "adapter_model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (
        read_metrics(tmp_path / "a" / "metrics.jsonl")[-1]["loss"]
        == (read_metrics(tmp_path / "b" / "metrics.jsonl")[-1]["loss"])
    )

    # A resume loads its weights through the strategy too.
    (tmp_path / "b" / "final").rename(tmp_path / "b-final")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-000004")
    recipe.train(
        make_config(tiny_llama_dir, train_file, tmp_path / "b", *common), log=lambda _: None
    )
    assert strategy.loaded == 1 and len(strategy.wrapped) == 2


def test_test_file_names_are_unique() -> None:
    """pytest imports a test file outside a package by its base name: two files of one name
    in different folders stop the whole collection ("import file mismatch")."""
    tests = Path(__file__).resolve().parents[1]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) > 50
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_test_files_share_helpers_through_support_modules_only() -> None:
    """Never from another test file, and never `from conftest import`: pytest imports each
    conftest under that one name, so the one a test file got would depend on collection order."""
    tests = Path(__file__).resolve().parents[1]
    files = sorted(tests.rglob("test_*.py"))  # unit/<package>/, integration/, distributed/, slow/
    assert len(files) > 50
    imports = {
        f"{p.name}: {node.module}"
        for p in files
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom)
        and node.module
        and (node.module.startswith("test_") or node.module == "conftest")
    }
    assert imports == set()
