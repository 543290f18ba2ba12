"""The architecture matrix (issue 31): every family of tests/model_zoo.py, with its real chat
template, trains with leantune's defaults (LoRA and full, a system message in the data), exports
to HF with the parity check, and, after a few steps on short answers, generates an answer that
stops at the template's end-of-turn token.

The loss against each model's own forward is tests/test_model_loss.py, the supervision per
template tests/test_template_supervision.py, the segment attention tests/test_attention.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli, write_jsonl
from model_zoo import FAMILIES, plant_chats, save_family_model

FAST = (
    "run.progress=false",
    "data.eval=null",
    "train.eval_exact_match=false",
    "train.save_every=0",
)


@pytest.fixture(scope="module")
def plant_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 plant-care chats of 1-3 turns, 10 with a system message (the issue's data)."""
    return write_jsonl(tmp_path_factory.mktemp("plants") / "chat.jsonl", plant_chats(40))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_lora_and_full_train_with_the_defaults_and_export_with_parity(
    name: str, plant_file: Path, tmp_path: Path
) -> None:
    model = save_family_model(tmp_path / "model", name)
    for method in ("lora", "full"):
        run = tmp_path / f"run-{method}"
        done = run_cli(
            [
                "train",
                f"model.path={model}",
                f"data.train={plant_file}",
                f"method.name={method}",
                "train.max_steps=2",
                f"run.dir={run}",
                *FAST,
            ]
        )
        assert done.code == 0, done
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 2, summary
        assert all(
            0 < r["loss"] < 20
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r
        )
    exported = run_cli(
        ["export", str(tmp_path / "run-lora"), "--format", "hf", "--out", str(tmp_path / "hf")]
    )
    assert exported.code == 0, exported
    assert "parity" in exported.out + exported.err


SHORT = [
    {
        "messages": [
            {"role": "user", "content": f"How often should I water the {plant}?"},
            {"role": "assistant", "content": "Weekly."},
        ]
    }
    for plant in ("fern", "cactus", "basil", "ivy")
]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_generate_stops_at_the_end_of_turn_after_training_on_short_answers(
    name: str, tmp_path: Path
) -> None:
    model = save_family_model(tmp_path / "model", name)
    data = write_jsonl(tmp_path / "short.jsonl", SHORT * 4)
    run = tmp_path / "run"
    done = run_cli(
        [
            "train",
            f"model.path={model}",
            f"data.train={data}",
            "method.name=full",
            "train.lr=3e-3",
            "train.max_steps=25",
            "train.warmup_ratio=0",
            f"run.dir={run}",
            *FAST,
        ]
    )
    assert done.code == 0, done
    out = run_cli(
        [
            "generate",
            "--model",
            str(run),
            "--prompt",
            "How often should I water the fern?",
            "--max-new-tokens",
            "12",
        ]
    )
    assert out.code == 0, out
    assert out.out.strip().splitlines()[-1].strip() == "Weekly."
