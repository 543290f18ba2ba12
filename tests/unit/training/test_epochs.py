"""Epochs, small data and lengths: how many steps a run takes, what each step holds, how long
its rows are, and whether they are packed.

- A step never holds the same row twice: a step's window of the sample stream stops at the end
  of the epoch (`SampleStream.window`), so data smaller than one global batch gives steps of
  every row once, never a row fed several times.
- `train.epochs` decides the steps (rows / global batch, rounded up, times epochs);
  `train.max_steps` alone is the number of steps, and with epochs it caps them.
- `data.max_seq_len=auto` is the longest example (up to the model's context), `data.pack=auto`
  packs where the method allows it and `train.micro_batch_size=auto` is the default.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from support import prepare_rows, run_cli, write_jsonl

from leantune.data.loader import SampleStream
from leantune.methods.checks import effective_pack
from leantune.monitor.metrics import read_metrics
from leantune.training.checks import load_config
from leantune.training.run_setup import default_global_batch, steps_for

SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_MICRO_BATCH"


def chat_rows(n: int, offset: int = 0) -> list[dict]:
    items = ["lamp", "desk", "phone", "cable"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Order {i}: a {items[i % 4]}. Status?"},
                {"role": "assistant", "content": json.dumps({"item": items[i % 4], "id": i})},
            ]
        }
        for i in range(offset, offset + n)
    ]


def alpaca_rows(n: int) -> list[dict]:
    return [
        {"instruction": f"Name item {i}.", "input": "", "output": f"item {i}"} for i in range(n)
    ]


def own_data_args(model: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """`leantune train` on the user's own file with the library defaults (no CONFIG)."""
    return [
        "train",
        f"model.path={model}",
        f"data.train={data}",
        f"run.dir={run_dir}",
        "run.progress=false",
        "train.lr=1e-2",
        *extra,
    ]


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "leantune_run.json").read_text())["fingerprint"]


# ---------------------------------------------------------------------------------------------
# The sample stream


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    rows=st.integers(1, 40),
    batch=st.integers(1, 70),
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 12),
)
def test_a_step_never_holds_a_row_twice(rows: int, batch: int, seed: int, steps: int) -> None:
    stream = SampleStream(rows, seed)
    position, seen_this_epoch = 0, set()
    for _ in range(steps):
        window = stream.window(position, batch)
        assert len(set(window)) == len(window) == min(batch, rows - position % rows)
        assert not seen_this_epoch & set(window)  # each row once per epoch
        seen_this_epoch |= set(window)
        position += len(window)
        if position % rows == 0:
            assert seen_this_epoch == set(range(rows))
            seen_this_epoch = set()
        # A pure function of the position: a resumed run sees the same window.
        assert SampleStream(rows, seed).window(position - len(window), batch) == window


def test_the_steps_follow_epochs_and_max_steps_caps_them() -> None:
    # 10 rows in steps of 4: 4 + 4 + 2 rows per epoch.
    assert steps_for(rows=10, global_batch=4, epochs=None, max_steps=None) == 3
    assert steps_for(rows=10, global_batch=4, epochs=2, max_steps=None) == 6
    assert steps_for(rows=10, global_batch=4, epochs=2, max_steps=5) == 5
    assert steps_for(rows=10, global_batch=4, epochs=2, max_steps=50) == 6
    assert steps_for(rows=10, global_batch=4, epochs=None, max_steps=50) == 50
    # Fewer rows than one global batch: one step per epoch.
    assert steps_for(rows=1, global_batch=32, epochs=3, max_steps=None) == 3


def test_epochs_is_checked_like_every_count(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    result = run_cli(["validate", f"data.train={data}", "train.epochs=0"])
    assert result.code == 2 and "train.epochs" in result.err, result
    assert load_config(None, [f"data.train={data}", "train.epochs=3"]).train.epochs == 3


# ---------------------------------------------------------------------------------------------
# Whole runs on the tiny model


def test_16_examples_with_a_global_batch_of_32_never_repeat_a_row(
    tiny_llama_dir: Path, tokenizer, tmp_path: Path
) -> None:
    """Data smaller than one step: 16 alpaca examples packed into one row, a global batch of 32."""
    data = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows(16))
    run = tmp_path / "run"
    extra = ("data.format=alpaca", "data.max_seq_len=512", "train.max_steps=3")
    result = run_cli(own_data_args(tiny_llama_dir, data, run, *extra, "train.global_batch_size=32"))
    assert result.code == 0, result.err
    prepared = prepare_rows(data, "alpaca", tokenizer, 512, pack=True)
    assert len(prepared.rows) == 1  # all 16 examples in one packed row
    tokens = len(prepared.rows[0].input_ids)
    steps = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["tokens"] == tokens for m in steps), [m["tokens"] for m in steps]
    (line,) = [x for x in result.out.splitlines() if "global batch" in x and "fewer" in x]
    assert "1 row" in line and "32" in line
    # A fixed micro-batch: the same window, the same rule.
    fixed = tmp_path / "fixed"
    again = run_cli(
        own_data_args(
            tiny_llama_dir, data, fixed, *extra, "train.micro_batch_size=4", "train.grad_accum=8"
        )
    )
    assert again.code == 0, again.err
    assert all(m["tokens"] == tokens for m in read_metrics(fixed / "metrics.jsonl"))


def test_two_epochs_give_the_computed_steps_and_the_record_keeps_them(
    tiny_llama_dir: Path, tokenizer, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(10))
    run = tmp_path / "run"
    batch = ("data.pack=false", "train.micro_batch_size=2", "train.grad_accum=2")
    result = run_cli(own_data_args(tiny_llama_dir, data, run, *batch, "train.epochs=2"))
    assert result.code == 0, result.err
    steps = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]  # 2 x (4 + 4 + 2 rows)
    prepared = prepare_rows(data, "chat", tokenizer, 512, pack=False)
    epoch_tokens = sum(len(r.input_ids) for r in prepared.rows)
    assert sum(m["tokens"] for m in steps[:3]) == sum(m["tokens"] for m in steps[3:])
    assert sum(m["tokens"] for m in steps[:3]) == epoch_tokens
    assert any("6 steps" in x and "2 epochs" in x for x in result.out.splitlines()), result.out
    fields = record(run)
    assert (fields["train.max_steps"], fields["train.epochs"]) == (6, 2)
    # max_steps caps the epochs.
    capped = tmp_path / "capped"
    args = own_data_args(
        tiny_llama_dir, data, capped, *batch, "train.epochs=2", "train.max_steps=4"
    )
    assert run_cli(args).code == 0
    assert [m["step"] for m in read_metrics(capped / "metrics.jsonl")] == [1, 2, 3, 4]


def test_one_epoch_is_the_default_for_own_data(tiny_llama_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(10))
    run = tmp_path / "run"
    batch = ("data.pack=false", "train.micro_batch_size=2", "train.grad_accum=2")
    assert run_cli(own_data_args(tiny_llama_dir, data, run, *batch)).code == 0
    assert len(read_metrics(run / "metrics.jsonl")) == 3


def test_resume_across_an_epoch_boundary_is_bit_exact(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 rows in steps of 4 (the last step of each epoch holds 2): a SIGTERM in step 4, the
    first of epoch 2, then the same command, against the uninterrupted run."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(10))
    batch = ("data.pack=false", "train.micro_batch_size=2", "train.grad_accum=2")
    extra = (*batch, "train.epochs=2", "train.save_every=0", "method.dropout=0.1")
    straight = tmp_path / "straight"
    assert run_cli(own_data_args(tiny_llama_dir, data, straight, *extra)).code == 0
    run = tmp_path / "run"
    args = own_data_args(tiny_llama_dir, data, run, *extra)
    # Micro-batches: steps 1-2 hold 2 each, step 3 one (2 rows); 5 is the first of step 4's.
    monkeypatch.setenv(SIGNAL_ENV, "5:TERM")
    stopped = run_cli(args)
    monkeypatch.delenv(SIGNAL_ENV)
    assert stopped.code == 143, stopped
    state = json.loads((run / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    assert state["extra"]["batching"]["samples_seen"] == 10  # one whole epoch
    resumed = run_cli(args)
    assert resumed.code == 0 and "resumed from" in resumed.out, resumed
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    for key in ("step", "loss", "lr", "grad_norm", "tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    wa = load_file(straight / "final" / "adapter_model.safetensors")
    wb = load_file(run / "final" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_max_seq_len_follows_the_data_and_the_data_is_tokenised_once(
    tiny_llama_dir: Path, tokenizer, tmp_path: Path
) -> None:
    rows = chat_rows(8)
    rows[3]["messages"][1]["content"] = "a longer answer " * 6
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run = tmp_path / "run"
    result = run_cli(own_data_args(tiny_llama_dir, data, run, "train.max_steps=2"))
    assert result.code == 0, result.err
    longest = max(len(e.input_ids) for e in prepare_rows(data, "chat", tokenizer, 512, False).rows)
    assert record(run)["data.max_seq_len"] == longest
    (line,) = [x for x in result.out.splitlines() if x.startswith("data.max_seq_len=auto")]
    assert str(longest) in line and "512" in line  # the choice, and the model's context
    caches = [p for p in (run / "prepared").iterdir() if p.is_dir()]
    assert len(caches) == 1, caches  # tokenised once, at the model's context
    again = run_cli(own_data_args(tiny_llama_dir, data, run, "train.max_steps=2"))
    assert again.code == 0, again.err[-3000:]
    assert [p for p in (run / "prepared").iterdir() if p.is_dir()] == caches


def test_an_example_beyond_the_models_context_is_a_bad_line(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    rows = chat_rows(20)
    rows[5]["messages"][1]["content"] = "word " * 700  # the tiny model's context is 512
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run = tmp_path / "run"
    result = run_cli(own_data_args(tiny_llama_dir, data, run, "train.max_steps=1"))
    assert result.code == 0, result.err
    assert "bad line skipped" in result.out and ":6:" in result.out, result.out
    assert record(run)["data.max_seq_len"] < 512


@pytest.mark.parametrize(
    ("method", "packed"),
    [("lora", True), ("full", True), ("prefix", False), ("ptuning_v2", False), ("prompt", False)],
)
def test_pack_auto_follows_the_method(method: str, packed: bool, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    cfg = load_config(None, [f"data.train={data}", f"method.name={method}"])  # no ConfigError
    assert cfg.data.pack == "auto"
    assert effective_pack(cfg.data.pack, method) is packed
    assert effective_pack(True, method) is True and effective_pack(False, method) is False
    # The demo with another method: the demo's packing follows the method too.
    assert load_config(None, [f"method.name={method}"]).data.pack == "auto"


def test_pack_auto_is_said_once_and_recorded(tiny_llama_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(6))
    for method, packed in (("lora", True), ("prompt", False)):
        run = tmp_path / method
        extra = (f"method.name={method}", "train.max_steps=1", "train.lr=null")
        result = run_cli(own_data_args(tiny_llama_dir, data, run, *extra))
        assert result.code == 0, result.err
        lines = [x for x in result.out.splitlines() if x.startswith("data.pack=auto")]
        assert len(lines) == 1, result.out
        assert (("one example per row" in lines[0]) is not packed) and method in lines[0]
        assert record(run)["data.pack"] is packed


def test_the_default_global_batch_holds_about_8_examples() -> None:
    """HF Trainer's default batch is 8 examples; a packed row holds several, so the default
    global batch is the rows that hold 8 on average, never 8 packed rows."""
    assert default_global_batch(rows=24, examples=24) == 8  # unpacked: 8 rows
    assert default_global_batch(rows=45, examples=128) == 3  # 2.8 rows hold 8 examples
    assert default_global_batch(rows=10, examples=40) == 2
    assert default_global_batch(rows=1, examples=16) == 1  # never below one row
    # Under torchrun every process takes an equal share: a multiple of the world size.
    assert default_global_batch(rows=45, examples=128, processes=2) == 4
    assert default_global_batch(rows=24, examples=24, processes=3) == 9


def test_a_packed_run_takes_8_examples_per_step_by_default(
    tiny_llama_dir: Path, tokenizer, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    prepared = prepare_rows(data, "chat", tokenizer, 128, pack=True)
    rows = len(prepared.rows)
    assert 4 <= rows <= 20, rows  # several examples per row
    batch = default_global_batch(rows, 40)
    assert batch < 8
    run = tmp_path / "run"
    result = run_cli(own_data_args(tiny_llama_dir, data, run, "data.max_seq_len=128"))
    assert result.code == 0, result.err
    (line,) = [x for x in result.out.splitlines() if "train.global_batch_size unset" in x]
    assert f"global batch {batch} row" in line and f"are in {rows} rows" in line, line
    assert record(run)["train.global_batch"] == batch
    steps = read_metrics(run / "metrics.jsonl")
    assert len(steps) == -(-rows // batch)  # one epoch
    assert steps[0]["micro_batch_size"] * steps[0]["grad_accum"] == batch
    # `leantune plan` predicts the batch `train` takes on this data.
    planned = run_cli(
        ["plan", f"model.path={tiny_llama_dir}", f"data.train={data}", "data.max_seq_len=128",
         "--json"]
    )  # fmt: skip
    assert planned.code == 0, planned.err
    configured = json.loads(planned.out)["configured"]
    assert configured["micro_batch"] * configured["grad_accum"] == batch, configured
    # The same command resumes the finished run instead of refusing its fingerprint.
    again = run_cli(own_data_args(tiny_llama_dir, data, run, "data.max_seq_len=128"))
    assert again.code == 0, again.err
    assert len(read_metrics(run / "metrics.jsonl")) == len(steps)


def test_micro_batch_size_auto_is_the_default_for_own_data(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(24))
    run = tmp_path / "run"
    result = run_cli(
        own_data_args(tiny_llama_dir, data, run, "data.pack=false", "train.max_steps=1")
    )
    assert result.code == 0, result.err
    (line,) = [x for x in result.out.splitlines() if x.startswith("micro_batch_size=auto")]
    assert "global batch 8" in line and "planner predicts" in line
    rows = read_metrics(run / "metrics.jsonl")
    assert rows[0]["micro_batch_size"] * rows[0]["grad_accum"] == 8
    # Where the planner cannot model the run, a fixed micro-batch instead of a stop.
    import leantune.memory.resolve as resolve

    def cannot(*args: object, **kwargs: object) -> None:
        raise ValueError("memory planner: cannot apply method.name=lora: needs real weights")

    monkeypatch.setattr(resolve, "plan_basis", cannot)
    other = tmp_path / "other"
    result = run_cli(
        own_data_args(tiny_llama_dir, data, other, "data.pack=false", "train.max_steps=1")
    )
    assert result.code == 0, result.err
    (line,) = [x for x in result.out.splitlines() if x.startswith("micro_batch_size=auto")]
    assert "needs real weights" in line and "micro-batch 4 x grad_accum 2" in line
    assert read_metrics(other / "metrics.jsonl")[0]["micro_batch_size"] == 4


def test_micro_batch_size_auto_over_budget_trains_at_one_with_a_warning(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto is the default: a prediction over the budget is advice, not a stop (an explicit
    train.memory_budget still stops a real out of memory at micro-batch 1 with exit 5)."""
    import leantune.memory.budget as memory_budget

    monkeypatch.setattr(memory_budget, "default_budget", lambda device: 1000)
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(8))
    run = tmp_path / "run"
    result = run_cli(own_data_args(tiny_llama_dir, data, run, "train.max_steps=1"))
    assert result.code == 0, result
    (line,) = [x for x in result.out.splitlines() if "micro_batch_size=auto" in x]
    assert line.startswith("warning:") and "even micro-batch 1" in line and "1 x grad_accum" in line
    assert read_metrics(run / "metrics.jsonl")[0]["micro_batch_size"] == 1
