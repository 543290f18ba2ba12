"""`leantune.layout` names every file of a run directory once, and a run writes only those.

The names are checked here as literals: they are the on-disk contract that `report`, the
dashboard, resume and runs copied from older versions read back.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import make_config

from leantune.layout import (
    ModelPaths,
    PreparedPaths,
    RunPaths,
    checkpoint_name,
    checkpoint_step,
)
from leantune.monitor.summary import finished_summary, read_summary, write_summary_file
from leantune.training.recipe import train

NOT_WRITTEN_BY_A_PLAIN_RUN = {
    "events": "only once the guard or the OOM recovery decides something",
    "paused": "only while the guard has paused the run",
    "monitor_ids": "only with monitor.wandb or monitor.mlflow",
    "tensorboard": "only with monitor.tensorboard",
    "wandb": "only with monitor.wandb",
    "start_model": "only when model.path is a run whose final/ is an adapter",
}


@pytest.mark.parametrize("layout", [RunPaths, PreparedPaths, ModelPaths])
def test_every_name_is_unique_and_a_plain_entry_of_its_directory(layout: Any) -> None:
    names = layout.names()
    assert names and len(set(names.values())) == len(names), names
    assert all(n and "/" not in n and n not in (".", "..") for n in names.values()), names
    root = Path("/some/dir")
    for attr, name in names.items():
        assert getattr(layout(root), attr) == root / name  # the instance's path ...
        assert getattr(layout, attr) == name  # ... and the class's name agree


def test_the_run_directory_names_are_the_on_disk_contract() -> None:
    assert RunPaths.names() == {
        "lock": ".leantune.lock",
        "record": "leantune_run.json",
        "config": "config.yaml",
        "memory_plan": "memory_plan.json",
        "metrics": "metrics.jsonl",
        "eval": "eval.jsonl",
        "events": "events.jsonl",
        "paused": "PAUSED",
        "eval_predictions": "eval_predictions.jsonl",
        "summary": "summary.json",
        "report": "report.html",
        "monitor_ids": "monitor_runs.json",
        "tensorboard": "tensorboard",
        "wandb": "wandb",
        "checkpoints": "checkpoints",
        "final": "final",
        "prepared": "prepared",
        "start_model": "start_model",
    }
    assert PreparedPaths.names() == {
        "report": "prepare_report.json",
        "rejected": "rejected.jsonl",
    }


def test_checkpoint_names_sort_as_steps_and_read_back() -> None:
    assert checkpoint_name(12) == "step-000012"
    assert [checkpoint_step(checkpoint_name(s)) for s in (0, 7, 123456, 1234567)] == [
        0,
        7,
        123456,
        1234567,
    ]
    for other in ("step-", "step-12a", ".tmp-step-000012-99", ".old-step-000012-3", "final"):
        assert checkpoint_step(other) is None, other
    assert RunPaths(Path("r")).checkpoint(4) == Path("r/checkpoints/step-000004")


def test_a_folder_is_a_run_by_its_record_or_an_older_leantunes_checkpoints(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert not paths.is_run()
    paths.checkpoints.mkdir()
    assert not paths.is_run()  # an empty checkpoints/ is no run
    paths.checkpoint(3).mkdir()
    assert paths.is_run()
    other = RunPaths(tmp_path / "other")
    other.root.mkdir()
    other.record.write_text("{}")
    assert other.is_run()


def test_the_layout_imports_nothing() -> None:
    code = "import sys, leantune.layout; print(sorted(m for m in sys.modules if 'leantune' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["['leantune',", "'leantune.layout']"], done.stdout


def test_summary_round_trips_in_its_file_format(tmp_path: Path) -> None:
    summary = {"steps": 4, "train_time_s": 1.25, "eval_exact_match": 0.5, "adapted": {"a": [1]}}
    path = write_summary_file(tmp_path, summary)
    assert path == tmp_path / "summary.json"
    assert path.read_text() == json.dumps(summary, indent=2) + "\n"
    assert read_summary(tmp_path) == summary == finished_summary(tmp_path)


@pytest.mark.parametrize("text", [None, '{"steps": 4', "[1, 2]", "\xff\xfe"])
def test_a_missing_torn_or_foreign_summary_reads_as_none(tmp_path: Path, text: str | None) -> None:
    if text is not None:
        (tmp_path / "summary.json").write_bytes(text.encode("latin-1"))
    assert read_summary(tmp_path) is None
    with pytest.raises(FileNotFoundError, match=r"summary\.json: missing or damaged"):
        finished_summary(tmp_path)


def test_a_run_writes_exactly_the_files_the_layout_names(
    tiny_llama_dir: Path, chat_files: tuple[Path, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    cfg = make_config(
        tiny_llama_dir,
        chat_files[0],
        run_dir,
        f"data.eval={chat_files[1]}",
        "train.max_steps=2",
        "train.save_every=1",
        "train.eval_every=2",
        "train.eval_exact_match=true",
        "train.max_new_tokens=4",
    )
    summary = train(cfg, log=lambda _: None)
    paths = RunPaths(run_dir)
    written = {p.name for p in run_dir.iterdir()}
    names = RunPaths.names()
    expected = {names[a] for a in names if a not in NOT_WRITTEN_BY_A_PLAIN_RUN}
    assert written == expected
    assert read_summary(run_dir) == summary
    assert sorted(p.name for p in paths.checkpoints.iterdir()) == [
        checkpoint_name(1),
        checkpoint_name(2),
    ]
    final = ModelPaths(paths.final)
    own = (final.adapter_config, final.adapter_weights, final.base_pointer, final.tokenizer_config)
    assert all(entry.is_file() for entry in own), sorted(p.name for p in final.root.iterdir())


SRC = Path(__file__).resolve().parents[2] / "src" / "leantune"
ALLOWED = {
    # A checkpoint folder's own weights file, named like an HF model's by choice, not by rule.
    ("training/state/checkpoint.py", "model.safetensors"),
}


def _spelled_names(tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    """Layout names written as string literals: a file name anywhere but in a docstring, a
    folder name where a path is joined (``run_dir / "final"``)."""
    docstrings: set[int] = set()
    found = set()
    for node in ast.walk(tree):  # breadth first: a docstring's statement comes before it
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docstrings.add(id(node.value))
        elif isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings:
            if "." in node.value.strip("."):  # a file name: never a word of something else
                found.add((node.lineno, node.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = node.right
            if isinstance(right, ast.Constant) and right.value in names:
                found.add((right.lineno, right.value))
    return sorted(found)


def test_no_module_spells_a_layout_name_itself() -> None:
    names = {
        *RunPaths.names().values(),
        *PreparedPaths.names().values(),
        *ModelPaths.names().values(),
    }
    spelled = []
    for path in sorted(SRC.rglob("*.py")):
        rel, text = path.relative_to(SRC).as_posix(), path.read_text(encoding="utf-8")
        if rel == "layout.py" or not any(f'"{n}"' in text or f"'{n}'" in text for n in names):
            continue  # parsing only the files that hold one keeps this test fast
        spelled += [
            f"{rel}:{line}: {name!r}"
            for line, name in _spelled_names(ast.parse(text), names)
            if (rel, name) not in ALLOWED
        ]
    assert spelled == [], "name these through leantune.layout:\n" + "\n".join(spelled)
