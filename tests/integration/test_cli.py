"""The command line: train, validate, eval and generate on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import write_jsonl

from leantune.cli.app import main

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Order {i}?"},
            {"role": "assistant", "content": json.dumps({"id": i})},
        ]
    }
    for i in range(12)
]


@pytest.fixture()
def trained_run(tmp_path: Path, tiny_qwen2_dir: Path) -> Path:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            f"model.path={tiny_qwen2_dir}",
            f"data.train={train}",
            "data.eval=null",
            "data.max_seq_len=64",
            "train.eval_exact_match=false",
            "train.max_steps=2",
            "train.micro_batch_size=4",
            f"run.dir={run_dir}",
            "run.progress=false",
        ]
    )
    assert code == 0
    return run_dir


def test_validate_ok_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate"]) == 0
    assert "is valid" in capsys.readouterr().out
    assert main(["validate", "train.micro_batch_size=0"]) == 2
    assert "train.micro_batch_size: must be >= 1" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method:\n  name: prefix-magic\n")
    assert main(["validate", str(cfg)]) == 2
    assert f"{cfg}:2: method.name: 'prefix-magic' is not one of" in capsys.readouterr().err


def test_train_reports_bad_data_and_refuses(tmp_path: Path, tiny_qwen2_dir: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{oops\n')
    code = main(
        [
            "train",
            f"model.path={tiny_qwen2_dir}",
            f"data.train={bad}",
            "data.eval=null",
            "train.eval_exact_match=false",
            f"run.dir={tmp_path / 'r'}",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert f"{bad}:1: field 'messages' must be a non-empty list" in err
    assert f"{bad}:2: invalid JSON" in err


def test_eval_prints_loss_perplexity_and_exact_match(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_jsonl(tmp_path / "eval.jsonl", ROWS[:5])
    capsys.readouterr()
    code = main(
        [
            "eval",
            "--model",
            str(trained_run / "final"),
            "--data",
            str(data),
            "--limit",
            "3",
            "--max-new-tokens",
            "8",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "chat" and out["examples"] == 3
    assert out["loss"] > 0 and out["perplexity"] == pytest.approx(2.718281828 ** out["loss"])
    assert 0.0 <= out["exact_match"] <= 1.0


def test_eval_text_format_has_no_exact_match(tiny_qwen2_dir: Path, tmp_path: Path, capsys) -> None:
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, {"text": "the fox"}])
    assert main(["eval", "--model", str(tiny_qwen2_dir), "--data", str(data)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "text" and "exact_match" not in out and out["examples"] == 2


def test_generate_is_seeded_and_greedy_is_deterministic(trained_run: Path, capsys) -> None:
    final = str(trained_run / "final")
    args = ["generate", "--model", final, "--prompt", "Order 3?", "--max-new-tokens", "6"]
    outputs = []
    for extra in (["--temperature", "0"], ["--temperature", "0"], ["--seed", "1"], ["--seed", "1"]):
        capsys.readouterr()
        assert main([*args, *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[2] == outputs[3]


def test_generate_chat_keeps_the_conversation(
    trained_run: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    seen: list[str] = []
    import leantune.eval.generation as generation

    real = generation.generate_texts

    def spy(model, tokenizer, prompts, settings, batch_size=16, seed=None, **kw):  # type: ignore[no-untyped-def]
        seen.extend(prompts)
        return real(model, tokenizer, prompts, settings, batch_size, seed, **kw)

    monkeypatch.setattr(generation, "generate_texts", spy)
    answers = iter(["second question", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _: next(answers))
    code = main(
        [
            "generate",
            "--model",
            str(trained_run / "final"),
            "--chat",
            "--prompt",
            "first question",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
        ]
    )
    assert code == 0
    assert len(seen) == 2
    assert "first question" in seen[1] and "second question" in seen[1]
    assert seen[1].startswith(seen[0])
    assert capsys.readouterr().out.count("assistant> ") == 2
