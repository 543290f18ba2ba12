"""`leantune bench methods` on a tiny model: one row per method, from each run's own files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import write_jsonl

from leantune.bench.methods import MethodResult, add_retention, markdown_table
from leantune.cli.app import main
from leantune.config import MethodConfig
from leantune.methods.registry import apply_method, count_parameters
from leantune.models.loading import load_model, resolve_model

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Ticket {i}?"},
            {"role": "assistant", "content": json.dumps({"id": i})},
        ]
    }
    for i in range(16)
]


def test_bench_methods_end_to_end(
    tmp_path: Path,
    tiny_llama_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", ROWS[:4])
    out = tmp_path / "bench"
    common = [
        f"model.path={tiny_llama_dir}",
        f"data.train={train}",
        f"data.eval={held_out}",
        "data.max_seq_len=64",
        "train.eval_exact_match=true",
        "train.max_new_tokens=8",
        "train.micro_batch_size=2",
        # A KL penalty is valid for lora but refused for full: full must become a failed row,
        # not the end of the benchmark.
        "train.kl_coef=0.1",
        "--steps",
        "2",
        "--lr",
        "lora=1e-3",
    ]
    code = main(["bench", "methods", *common, "--methods", "lora,full", "--out", str(out)])
    assert code == 2  # full's run refused its settings: the benchmark exits with its code
    last = capsys.readouterr().out.strip().splitlines()[-1]
    payload = json.loads(last)
    assert payload == json.loads((out / "methods.json").read_text())
    lora, full = payload["results"]
    assert (lora["method"], lora["status"], lora["lr"]) == ("lora", "ok", 1e-3)
    assert full["status"] == "failed" and "kl_coef" in full["error"]

    base = load_model(resolve_model(str(tiny_llama_dir)), dtype="fp32")
    model = apply_method(base, MethodConfig(name="lora"))
    trainable, total = count_parameters(model)
    assert (lora["trainable_params"], lora["total_params"]) == (trainable, total)
    metrics = [json.loads(x) for x in (out / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    tokens = sum(r["tokens"] for r in metrics)
    assert lora["tokens_per_s"] == pytest.approx(tokens / sum(r["step_time_s"] for r in metrics))
    summary = json.loads((out / "lora" / "summary.json").read_text())
    assert lora["eval_loss"] == summary["eval_loss"]
    assert payload["base_exact_match"] == summary["base_exact_match"] is not None
    assert payload["max_steps"] == 2
    assert (out / "methods.png").stat().st_size > 1000
    table = (out / "methods.md").read_text()
    from leantune.methods.registry import DEFAULT_LR

    assert "| lora | 0.001 |" in table and f"| full | {DEFAULT_LR['full']:g} | failed:" in table

    # --reuse reads the finished lora run back instead of training it again.
    import leantune.bench.methods as bench

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("--reuse trained a finished method again")

    monkeypatch.setattr(bench.subprocess, "run", no_training)
    args = [*common, "--methods", "lora", "--reuse", "--out", str(out)]
    assert main(["bench", "methods", *args]) == 0
    again_payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again_payload["results"] == [lora]
    assert again_payload["base_exact_match"] == payload["base_exact_match"]


def test_retention_is_relative_to_full() -> None:
    rows = [
        MethodResult("full", 2e-5, "ok", exact_match=0.8),
        MethodResult("lora", 2e-4, "ok", exact_match=0.6),
        MethodResult("prompt", 3e-2, "failed", error="boom | bad"),
    ]
    add_retention(rows)
    assert rows[0].retention == 1.0
    assert rows[1].retention == pytest.approx(0.75)
    assert rows[2].retention is None
    table = markdown_table(rows, 0.1)
    assert "failed: boom / bad" in table
    assert all(line.count("|") == 13 for line in table.splitlines() if line.startswith("|"))


def test_no_retention_without_full() -> None:
    rows = [MethodResult("lora", 2e-4, "ok", exact_match=0.6)]
    add_retention(rows)
    assert rows[0].retention is None
