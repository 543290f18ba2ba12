"""`leantune bench methods --sweep` on a tiny model, the LR grids, the choice by held-out loss,
the loss retention, and the generated instruction task."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from support import chat_rows, write_jsonl

from leantune.bench.instructions import FAMILIES, generate, number_words, write_task
from leantune.bench.methods import MethodResult, add_retention
from leantune.bench.sweep import MethodSweep, SweepPoint, lr_grid, parse_grids, run_sweep
from leantune.cli.app import main
from leantune.training.checks import load_config


def test_sweep_end_to_end_chooses_the_lowest_held_out_loss_and_reuses(
    tmp_path: Path,
    tiny_llama_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(16))
    held_out = write_jsonl(tmp_path / "eval.jsonl", chat_rows(4, offset=50))
    out = tmp_path / "sweep"
    common = [
        f"model.path={tiny_llama_dir}",
        f"data.train={train}",
        f"data.eval={held_out}",
        "data.max_seq_len=64",
        "data.pack=false",
        "train.micro_batch_size=2",
        "train.precision=fp32",
        "--steps",
        "3",
        "--sweep",
        "--methods",
        "lora,ia3",
        "--grid",
        "lora=1e-4:3e-2",
        "--points",
        "2",
        "--factor",
        "10",
        "--out",
        str(out),
    ]
    assert main(["bench", "methods", *common]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload == json.loads((out / "sweep.json").read_text())
    lora, ia3 = payload["sweeps"]
    assert [p["lr"] for p in lora["points"]] == [1e-4, 3e-2]  # the explicit grid
    assert [p["lr"] for p in ia3["points"]] == lr_grid(ia3["default_lr"], 2, 10.0)
    for sweep in (lora, ia3):
        losses = {}
        for p in sweep["points"]:
            run = out / sweep["method"] / f"lr-{p['lr']:g}"
            summary = json.loads((run / "summary.json").read_text())
            assert p["eval_loss"] == summary["eval_loss"] and "eval_exact_match" not in summary
            losses[p["lr"]] = p["eval_loss"]
        assert sweep["chosen_lr"] == min(losses, key=losses.__getitem__)
        assert payload["chosen_lr"][sweep["method"]] == sweep["chosen_lr"]
    # On 3 steps the larger LoRA rate lowers the loss more: the choice follows the loss.
    assert lora["chosen_lr"] == 3e-2
    assert f"| lora | {lora['default_lr']:g} | 0.03 |" in (out / "sweep.md").read_text()

    import leantune.bench.sweep as sweep

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("--reuse trained a finished run again")

    monkeypatch.setattr(sweep, "train_in_process", no_training)
    assert main(["bench", "methods", *common, "--reuse"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["sweeps"] == payload["sweeps"]


def test_grid_is_log_spaced_around_the_center_and_below_one() -> None:
    assert lr_grid(1e-3, 3, 10.0) == [1e-4, 1e-3, 1e-2]
    grid = lr_grid(2e-4, 4, math.sqrt(10))
    ratios = [b / a for a, b in itertools.pairwise(grid)]
    assert all(r == pytest.approx(math.sqrt(10), rel=1e-2) for r in ratios)
    assert math.prod(grid) == pytest.approx(2e-4**4, rel=1e-2)
    assert lr_grid(0.3, 3, 10.0) == [0.03, 0.3]  # 3.0 is no learning rate


@pytest.mark.parametrize(
    "text, message",
    [
        ("nope=1e-3", "unknown method"),
        ("lora=abc", "expected method=rate"),
        ("lora=2", "finite number in"),
        ("lora=nan:1e-3", "finite number in"),
        ("lora=", "finite number in"),
    ],
)
def test_bad_grids_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_grids(text, ["lora", "ia3"])
    assert parse_grids("ia3=1e-1:1e-2:1e-2", ["ia3"]) == {"ia3": [1e-2, 1e-1]}


def test_cli_refuses_a_factor_of_one_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "methods", "--sweep", "--factor", "1", "--out", str(tmp_path)]) == 2
    assert "--factor 1.0: must be a finite number above 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_failed_and_non_finite_runs_are_never_chosen() -> None:
    sweep = MethodSweep("ia3", 3e-3)
    sweep.points = [
        SweepPoint(1e-1, "failed", error="guard stopped the run"),
        SweepPoint(3e-2, "ok", eval_loss=math.nan),
        SweepPoint(1e-2, "ok", eval_loss=0.9),
        SweepPoint(3e-3, "ok", eval_loss=1.2),
    ]
    sweep.choose()
    assert sweep.chosen_lr == 1e-2
    sweep.points = sweep.points[:2]
    sweep.choose()
    assert sweep.chosen_lr is None


def test_loss_retention_is_the_share_of_full_fine_tunings_loss_reduction() -> None:
    rows = [
        MethodResult("full", 2e-5, "ok", eval_loss=0.5, exact_match=0.8),
        MethodResult("lora", 2e-4, "ok", eval_loss=1.0, exact_match=0.4),
        MethodResult("prompt", 3e-2, "ok", eval_loss=2.5, exact_match=0.0),
    ]
    add_retention(rows, base_loss=2.0)
    assert [r.loss_retention for r in rows] == [1.0, pytest.approx(2 / 3), pytest.approx(-1 / 3)]
    assert [r.retention for r in rows] == [1.0, 0.5, 0.0]
    fresh = [MethodResult("full", 2e-5, "ok", eval_loss=0.5)]
    add_retention(fresh)
    assert fresh[0].loss_retention is None


def test_instruction_task_is_deterministic_balanced_and_held_out(tmp_path: Path) -> None:
    train, held_out, valid = write_task(tmp_path, n_train=270, n_eval=45)
    again = write_task(tmp_path / "again", n_train=270, n_eval=45)
    assert train.read_text() == again[0].read_text()
    records = [json.loads(x) for x in train.read_text().splitlines()]
    evals = [json.loads(x) for x in held_out.read_text().splitlines()]
    valids = [json.loads(x) for x in valid.read_text().splitlines()]
    assert len(records) == 270 and len(evals) == len(valids) == 45
    keys = [{(r["instruction"], r["input"]) for r in rs} for rs in (records, evals, valids)]
    assert len(keys[0]) == 270 and len(keys[1]) == len(keys[2]) == 45
    assert not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]
    # Every family appears in the first block of the held-out set, and its answers are right.
    first = evals[: len(FAMILIES)]
    assert len({r["instruction"].split()[0] + r["instruction"][-6:] for r in first}) >= 8
    for r in records + evals:
        if r["instruction"] == "Sort these words alphabetically.":
            assert r["output"].split(", ") == sorted(r["input"].split(", "))
        if r["instruction"] == "Reverse the order of the words.":
            assert r["output"].split() == r["input"].split()[::-1]
    assert number_words(47) == "forty-seven" and number_words(13) == "thirteen"
    assert load_config(None, [f"data.train={train}", "data.format=alpaca"]).data.format == "alpaca"


def test_small_families_hold_out_their_own_entries() -> None:
    asked = [
        {r["instruction"] for r in generate(n, 0, split) if "capital" in r["instruction"]}
        for n, split in ((600, "train"), (100, "eval"), (100, "valid"))
    ]
    assert all(asked) and not asked[0] & asked[1] and not asked[0] & asked[2]
    assert not asked[1] & asked[2]


def test_bench_on_the_generated_instruction_task(
    tmp_path: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench"
    args = [f"model.path={tiny_llama_dir}", "data.max_seq_len=256", "train.micro_batch_size=2"]
    args += ["train.eval_limit=4", "train.max_new_tokens=4", "--steps", "1"]
    assert (
        main(
            [
                "bench",
                "methods",
                *args,
                "--task",
                "instructions",
                "--methods",
                "lora",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["task"] == "instructions"
    (row,) = payload["results"]
    assert row["status"] == "ok" and row["examples_seen"] == 2
    resolved = (out / "lora" / "config.yaml").read_text()
    assert "format: alpaca" in resolved and "instructions_train.jsonl" in resolved
    first = json.loads((out / "task-data" / "instructions_train.jsonl").read_text().splitlines()[0])
    assert set(first) == {"instruction", "input", "output"}


def test_a_failed_run_is_a_row_and_the_runs_get_the_sweep_settings(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def runner(config: str | None, overrides: list[str], log_file: Path) -> str | None:
        calls.append(overrides)
        lr = float(next(o for o in overrides if o.startswith("train.lr=")).split("=")[1])
        if lr > 0.05:
            return "TrainingHalted: the guard stopped the run"
        run_dir = Path(next(o for o in overrides if o.startswith("run.dir=")).split("=", 1)[1])
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"eval_loss": lr, "train_time_s": 1.0}))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
        return None

    grids = {"ia3": [1e-2, 3e-2, 1e-1]}
    # refused={}: no pre-check, since this config (x.y=1) only exists for the fake runner.
    (sweep,) = run_sweep(
        None, grids, {"ia3": 3e-3}, tmp_path, ["x.y=1"], lambda _: None, runner=runner, refused={}
    )
    assert [p.status for p in sweep.points] == ["ok", "ok", "failed"]
    assert sweep.points[2].error == "TrainingHalted: the guard stopped the run"
    assert sweep.chosen_lr == 1e-2
    assert all(c[0] == "x.y=1" and "train.eval_exact_match=false" in c for c in calls)
    assert all("method.name=ia3" in c and "run.resume=never" in c for c in calls)
