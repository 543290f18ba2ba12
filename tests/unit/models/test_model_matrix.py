"""The architecture matrix: every family of tests/model_zoo.py, with its real chat
template, trains with leantune's defaults (LoRA and full, a system message in the data), exports
to HF with the parity check, and, after a few steps on short answers, generates an answer that
stops at the template's end-of-turn token.

The loss against each model's own forward is tests/unit/models/test_model_loss.py, the
supervision per template tests/unit/data/test_template_supervision.py, the segment attention
tests/unit/models/test_attention.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_zoo import FAMILIES, plant_chats, save_family_model
from support import run_cli, write_jsonl

FAST = (
    "run.progress=false",
    "data.eval=null",
    "train.eval_exact_match=false",
    "train.save_every=0",
)


@pytest.fixture(scope="module")
def plant_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 plant-care chats of 1-3 turns, 10 with a system message."""
    return write_jsonl(tmp_path_factory.mktemp("plants") / "chat.jsonl", plant_chats(40))


SHORT = [
    {
        "messages": [
            *([{"role": "system", "content": "You are a careful gardener."}] if i % 2 else []),
            {"role": "user", "content": f"How often should I water the {plant}?"},
            {"role": "assistant", "content": "Weekly."},
        ]
    }
    for i, plant in enumerate(("fern", "cactus", "basil", "ivy"))
]


def _train(model: Path, data: Path, run: Path, *extra: str) -> dict[str, object]:
    done = run_cli(
        ["train", f"model.path={model}", f"data.train={data}", f"run.dir={run}", *FAST, *extra]
    )
    assert done.code == 0, done
    losses = [
        r["loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert losses and all(0 < x < 20 for x in losses), losses
    return json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_family_trains_exports_and_generates_with_the_defaults(
    name: str, plant_file: Path, tmp_path: Path
) -> None:
    """LoRA (the default method) for 2 steps on the plant chats, exported to HF with parity;
    full fine-tuning for 25 steps on short answers (half with a system message), after which
    greedy generation writes the answer and stops at the end-of-turn token."""
    model = save_family_model(tmp_path / "model", name)
    assert _train(model, plant_file, tmp_path / "lora", "train.max_steps=2")["steps"] == 2
    hf = tmp_path / "hf"
    exported = run_cli(["export", str(tmp_path / "lora"), "--format", "hf", "--out", str(hf)])
    assert exported.code == 0, exported
    assert json.loads((hf / "export_report.json").read_text())["passed"] is True
    short = write_jsonl(tmp_path / "short.jsonl", SHORT * 4)
    full = tmp_path / "full"
    _train(
        model,
        short,
        full,
        "method.name=full",
        "train.lr=3e-3",
        "train.max_steps=25",
        "train.warmup_ratio=0",
    )
    out = run_cli(
        [
            "generate",
            "--model",
            str(full),
            "--prompt",
            "How often should I water the fern?",
            "--max-new-tokens",
            "12",
        ]
    )
    assert out.code == 0, out
    assert out.out.strip().splitlines()[-1].strip() == "Weekly."
