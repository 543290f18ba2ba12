"""`train.compile`: the blocks' training forward compiled with torch.compile computes what the
eager run computes, evaluation stays eager, a new layout of a packed row compiles nothing new,
and what cannot work is refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import (
    _assert_same_run,
    _ok,
    _one_process,
    chat_rows,
    run_cli,
    tiny_llama_config,
    tiny_train_args,
    write_jsonl,
)

from leantune.config.parse import ConfigError
from leantune.training.checks import load_config


def _tiny_segment_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from leantune.models.attention import register_segment_attention

    torch.manual_seed(0)
    cfg = tiny_llama_config()
    cfg._attn_implementation = register_segment_attention()
    return AutoModelForCausalLM.from_config(cfg).float()


def _packed(lengths: list[int]) -> dict[str, torch.Tensor]:
    """One packed row of examples of `lengths` (restarting position ids)."""
    g = torch.Generator().manual_seed(sum(lengths) + len(lengths))
    ids = torch.randint(3, 300, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "position_ids": pos, "labels": ids}


def test_compiled_blocks_match_eager_and_leave_eval_and_layouts_alone() -> None:
    from torch._dynamo.utils import counters

    from leantune.training.compile import compile_blocks

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _tiny_segment_model(), _tiny_segment_model()
    assert compile_blocks(compiled) == len(compiled.model.layers) == 2
    batch = _packed([20, 12, 32])
    for model in (eager, compiled):
        model.train()
        model(**batch).loss.backward()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # the training forward went through Inductor
    for (name, a), (_, b) in zip(
        eager.named_parameters(), compiled.named_parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    # Another layout of a row of the same length: the attention is not traced, nothing new.
    compiled(**_packed([40, 24])).loss.backward()
    assert counters["stats"]["unique_graphs"] == graphs
    # Evaluation and generation run the eager forward: no compile.
    compiled.eval()
    with torch.no_grad():
        out = compiled(**_packed([16, 16])).logits
        ref = eager.eval()(**_packed([16, 16])).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def _compiled_run_args(tiny_llama_dir: Path, tmp_path: Path) -> list[str]:
    """A packed fp32 run of 3 steps with an eval set at the end (no `run.dir`)."""
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(24))
    held = write_jsonl(tmp_path / "eval.jsonl", chat_rows(4, offset=100))
    return [
        f"model.path={tiny_llama_dir}", f"data.train={train}", "data.format=chat",
        "data.max_seq_len=128", f"data.eval={held}", "train.eval_exact_match=false",
        "run.progress=false", "train.micro_batch_size=2", "train.max_steps=3", "train.lr=1e-2",
        "train.seed=3", "train.precision=fp32", "method.dropout=0", "data.pack=true",
    ]  # fmt: skip


def _eval_losses(tmp_path: Path) -> list[float]:
    return [
        json.loads((tmp_path / run / "summary.json").read_text())["eval_loss"]
        for run in ("eager", "compiled")
    ]


def test_train_compile_wraps_every_block_and_trains_as_eager(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default suite's sibling of the slow Inductor run below: `leantune train` with
    train.compile=true, in this process, with torch.compile's `aot_eager` backend (Dynamo
    traces the blocks and AOTAutograd splits forward and backward, as under Inductor, but no
    kernel is generated: seconds instead of a minute). The blocks went through the compiler,
    the curves, weights and eval loss are the eager run's. The Inductor kernels themselves are
    checked against eager by the first test of this file."""
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    compiled_blocks: list[str] = []  # the blocks given to torch.compile (libraries that wrap
    # their own functions at import, e.g. bitsandbytes, are not counted)

    def aot_eager(model: object, **kwargs: object) -> object:
        owner = getattr(model, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            compiled_blocks.append(type(owner).__name__)
        return real_compile(model, backend="aot_eager", **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "compile", aot_eager)
    torch._dynamo.reset()
    counters.clear()
    common = ["train", *_compiled_run_args(tiny_llama_dir, tmp_path)]
    eager = run_cli([*common, f"run.dir={tmp_path / 'eager'}"])
    assert eager.code == 0, eager
    assert not compiled_blocks and not counters["stats"]["unique_graphs"]  # nothing compiled
    compiled = run_cli([*common, "train.compile=true", f"run.dir={tmp_path / 'compiled'}"])
    torch._dynamo.reset()
    assert compiled.code == 0, compiled
    assert "train.compile: 2 blocks compile" in compiled.out + compiled.err
    assert compiled_blocks == ["LlamaDecoderLayer"] * 2  # each block, once
    assert counters["stats"]["unique_graphs"] > 0  # the training forward was traced
    _assert_same_run(tmp_path / "eager", tmp_path / "compiled")
    losses = _eval_losses(tmp_path)
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


@pytest.mark.slow
def test_a_compiled_run_trains_as_the_eager_one(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Through `leantune train` in its own process with Inductor (about 80 s, most of it the
    cold compile): packed rows, an eval set at the end, fp32; the same loss and gradient-norm
    curves and final weights, and Inductor really generated code."""
    common = _compiled_run_args(tiny_llama_dir, tmp_path)
    cache = tmp_path / "inductor"
    eager = _one_process([*common, f"run.dir={tmp_path / 'eager'}"])
    _ok(eager)
    compiled = _one_process(
        [*common, "train.compile=true", f"run.dir={tmp_path / 'compiled'}"],
        TORCHINDUCTOR_CACHE_DIR=str(cache),
    )
    _ok(compiled)
    assert "train.compile: 2 blocks compile" in compiled.stdout + compiled.stderr
    assert any(cache.rglob("*.py"))  # Inductor wrote kernels: the run was compiled
    _assert_same_run(tmp_path / "eager", tmp_path / "compiled")
    losses = _eval_losses(tmp_path)
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_compile_under_a_distributed_strategy_is_refused() -> None:
    for strategy in ("ddp", "fsdp2", "deepspeed"):
        with pytest.raises(ConfigError, match=r"train\.compile=true runs in one process"):
            load_config(None, ["train.compile=true", f"dist.strategy={strategy}"])


def test_compile_without_a_cxx_compiler_fails_before_the_run(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    run = tmp_path / "run"
    done = run_cli(tiny_train_args(tiny_llama_dir, train, run, "train.compile=true"))
    assert done.code == 2
    assert "train.compile=true needs a C++ compiler" in done.err
    assert "no-such-g++" in done.err and "train.compile=false" in done.err
    assert not (run / "checkpoints").exists()
