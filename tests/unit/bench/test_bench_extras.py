"""`leantune bench methods` without an optional extra: a method whose requirements are missing is
skipped before the first run, with its install line, and the benchmark exits 0 when every
method that could run ran."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from support import write_jsonl

import leantune.bench.methods as bench
from leantune.bench.sweep import train_in_process
from leantune.cli.app import main

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Ticket {i}?"},
            {"role": "assistant", "content": json.dumps({"id": i})},
        ]
    }
    for i in range(8)
]
INSTALL = "pip install 'leantune[lowbit]'"


@pytest.fixture
def no_lowbit(monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes (the lowbit extra) not installed, as `find_spec` answers without it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a)
    )


def _args(tmp_path: Path, model: Path) -> list[str]:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    return [
        f"model.path={model}",
        f"data.train={train}",
        "data.max_seq_len=64",
        "train.micro_batch_size=2",
        "--steps",
        "1",
        "--methods",
        "qlora,lora",
        "--out",
        str(tmp_path / "bench"),
    ]


def test_missing_extra_skips_before_the_first_run_and_exits_0(
    tmp_path: Path,
    tiny_llama_dir: Path,
    no_lowbit: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ran: list[list[str]] = []

    def in_process(cmd: list[str], log_file: Path) -> tuple[int, str | None]:
        # `leantune train` in this process (seconds, not a child's imports), under the fake.
        ran.append(cmd)
        reason = train_in_process(None, cmd[4:], log_file)
        return (0, None) if reason is None else (1, reason)

    monkeypatch.setattr(bench, "run_logged", in_process)
    code = main(["bench", "methods", *_args(tmp_path, tiny_llama_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    # Printed first, before any run starts, with the line that installs what is missing.
    assert lines[0].startswith("qlora: skipped") and INSTALL in lines[0], lines[:3]
    assert [c for c in ran if "method.name=qlora" in c] == []  # never started
    assert len(ran) == 1 and "method.name=lora" in ran[0]
    payload = json.loads(lines[-1])
    qlora, lora = payload["results"]
    assert (qlora["method"], qlora["status"], qlora["install"]) == ("qlora", "skipped", INSTALL)
    assert INSTALL in qlora["error"] and qlora["exit_code"] is None
    assert (lora["method"], lora["status"]) == ("lora", "ok")
    table = (tmp_path / "bench" / "methods.md").read_text()
    row = next(x for x in table.splitlines() if x.startswith("| qlora |"))
    assert "skipped: " in row and INSTALL in row


def test_a_method_that_fails_while_running_still_exits_1(
    tmp_path: Path,
    tiny_llama_dir: Path,
    no_lowbit: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(bench, "run_logged", lambda cmd, log_file: (1, "Killed"))
    code = main(["bench", "methods", *_args(tmp_path, tiny_llama_dir)])
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1
    statuses = [(r["method"], r["status"], r["error"]) for r in payload["results"]]
    assert statuses[1] == ("lora", "failed", "Killed")
    assert statuses[0][:2] == ("qlora", "skipped")


def test_sweep_skips_a_method_whose_extra_is_missing_and_exits_0(
    tmp_path: Path,
    tiny_llama_dir: Path,
    no_lowbit: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import leantune.bench.sweep as sweep

    ran: list[list[str]] = []

    def recorded(config: str | None, overrides: list[str], log_file: Path) -> str | None:
        ran.append(overrides)
        return train_in_process(config, overrides, log_file)

    monkeypatch.setattr(sweep, "train_in_process", recorded)
    held_out = write_jsonl(tmp_path / "eval.jsonl", ROWS[:2])
    args = [*_args(tmp_path, tiny_llama_dir), f"data.eval={held_out}"]
    code = main(["bench", "methods", *args, "--sweep", "--grid", "qlora=1e-4:1e-3,lora=1e-3"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("qlora: skipped") and INSTALL in lines[0], lines[:3]
    assert len(ran) == 1 and "method.name=lora" in ran[0]  # qlora's two rates never started
    payload = json.loads(lines[-1])
    qlora, lora = payload["sweeps"]
    assert (qlora["status"], qlora["install"], qlora["points"]) == ("skipped", INSTALL, [])
    assert INSTALL in qlora["error"] and qlora["chosen_lr"] is None
    assert (lora["status"], lora["chosen_lr"]) == ("ok", 1e-3)
    table = (tmp_path / "bench" / "sweep.md").read_text()
    row = next(x for x in table.splitlines() if x.startswith("| qlora |"))
    assert "skipped: " in row and INSTALL in row


@pytest.mark.parametrize(
    ("given", "measured"), [([], [True, False]), (["train.eval_base=false"], [False, False])]
)
def test_the_first_run_measures_the_base_unless_the_caller_says_it_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: list[str], measured: list[bool]
) -> None:
    """benchmarks/lora_inits.py runs one bench per initialisation: only its first needs the
    base model's exact match (minutes of generation on the demo)."""
    ran: list[list[str]] = []
    monkeypatch.setattr(bench, "run_logged", lambda cmd, log_file: (ran.append(cmd), (1, "x"))[1])
    lrs = {"lora": 2e-3, "full": 1e-4}
    bench.run_methods(None, ["lora", "full"], lrs, tmp_path, given, log=lambda s: None, refused={})
    assert [c[-1] == "train.eval_base=true" for c in ran] == measured, ran
