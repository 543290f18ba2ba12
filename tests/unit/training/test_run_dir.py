"""A run directory belongs to one run: a lock, no foreign folders, names that are names, and
failed starts that leave nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import run_cli, tiny_train_args, write_jsonl

SRC = Path(__file__).resolve().parents[3] / "src"

# Holds the run directory's lock the way `leantune train` does, then waits to be killed.
HOLDER = """
import sys, time
from pathlib import Path
from leantune.training.run.rundir import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""

# Claims a new run directory the way `leantune train` does and writes what train has written
# while it prepares its data (before its run record exists), then waits to be killed.
PREPARING = """
import sys, time
from pathlib import Path
from leantune.training.run.rundir import claim_run_dir
run = Path(sys.argv[1])
with claim_run_dir(run, False, print):
    (run / "checkpoints").mkdir()
    (run / "prepared" / "0123abcd").mkdir(parents=True)
    (run / "events.jsonl").write_text("")
    print("preparing", flush=True)
    time.sleep(600)
"""


def chat_rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Where is order {i}?"},
                {"role": "assistant", "content": json.dumps({"id": i})},
            ]
        }
        for i in range(n)
    ]


@pytest.fixture()
def chat_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))


def args(model: Path, data: Path, run_dir: Path | None, *extra: str) -> list[str]:
    return tiny_train_args(model, data, run_dir, "train.max_steps=2", *extra)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_second_process_exits_2_naming_the_holder_and_a_killed_holder_is_taken_over(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    assert run_cli(args(tiny_llama_dir, chat_file, run)).code == 0
    # The holder's save in progress, which a second start-up must not delete.
    saving = run / "checkpoints" / ".tmp-step-000004-4242"
    saving.mkdir()
    (saving / "model.safetensors").write_bytes(b"half written")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        second = run_cli(args(tiny_llama_dir, chat_file, run))
        assert second.code == 2, second
        assert f"pid {holder.pid}" in second.err and str(run) in second.err
        assert (saving / "model.safetensors").read_bytes() == b"half written"
    finally:
        holder.kill()  # SIGKILL: the kernel drops its lock
        holder.wait()
    third = run_cli(args(tiny_llama_dir, chat_file, run))
    assert third.code == 0, third.err
    assert "resumed from" in third.out


def test_a_second_start_while_the_first_prepares_its_data_names_the_holder(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    """The lock is asked before the folder is judged: a run directory whose first start has
    not written its run record yet is that start's, not a foreign folder; killed, its lock and
    leftovers are taken over by the next start."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    holder = subprocess.Popen(
        [sys.executable, "-c", PREPARING, str(run)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "preparing"
        before = sorted(p.name for p in run.rglob("*"))
        second = run_cli(args(tiny_llama_dir, chat_file, run))
        assert second.code == 2, second
        assert f"pid {holder.pid}" in second.err and str(run) in second.err, second.err
        assert "not a leantune run" not in second.err
        assert sorted(p.name for p in run.rglob("*")) == before
    finally:
        holder.kill()  # SIGKILL mid-preparation: no record, the lock and the leftovers stay
        holder.wait()
    third = run_cli(args(tiny_llama_dir, chat_file, run))
    assert third.code == 0, third.err
    assert (run / "final").is_dir()


def test_a_run_killed_with_sigkill_leaves_a_lock_the_next_start_takes_over(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(SRC), "LEANTUNE_KILL_AFTER_MICRO_BATCH": "2"}
    cmd = [sys.executable, "-m", "leantune", *args(tiny_llama_dir, chat_file, run)]
    cmd += ["train.max_steps=4", "train.save_every=2"]
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert (run / ".leantune.lock").read_text().strip() == str(killed_pid(killed, run))
    resumed = run_cli([*args(tiny_llama_dir, chat_file, run), "train.max_steps=4"])
    assert resumed.code == 0, resumed.err
    assert "resumed from" in resumed.out and "step 2" in resumed.out


def killed_pid(_: subprocess.CompletedProcess, run: Path) -> int:
    """The pid the killed process wrote into the lock file (it is gone, the lock with it)."""
    return int((run / ".leantune.lock").read_text())


def test_a_non_empty_folder_that_is_not_a_run_is_refused_untouched(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "mine"
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "important.txt").write_text("keep me\n")
    (folder / "config.yaml").write_text("mine: 1\n")
    (folder / "metrics.jsonl").write_text("my numbers\n")
    before = sorted(p.name for p in folder.rglob("*"))
    contents = snapshot(folder)
    result = run_cli(args(tiny_llama_dir, chat_file, folder))
    assert result.code == 2, result
    assert str(folder) in result.err and "not a leantune run" in result.err
    assert sorted(p.name for p in folder.rglob("*")) == before
    assert snapshot(folder) == contents


def test_run_dir_dot_next_to_the_config_never_overwrites_it(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    write_jsonl(project / "train.jsonl", chat_rows(12))
    config = project / "my.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_llama_dir)},
                "data": {"train": "train.jsonl", "eval": None, "format": "chat"},
                "train": {"max_steps": 2, "micro_batch_size": 2, "eval_exact_match": False},
                "run": {"dir": ".", "progress": False},
            }
        )
    )
    text = config.read_text()
    monkeypatch.chdir(project)
    result = run_cli(["train", "my.yaml"])
    assert result.code == 2, result
    assert "not a leantune run" in result.err
    assert config.read_text() == text
    assert sorted(p.name for p in project.iterdir()) == ["my.yaml", "train.jsonl"]


def test_the_run_config_as_input_is_used_but_never_rewritten(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    assert run_cli(args(tiny_llama_dir, chat_file, run)).code == 0
    config = run / "config.yaml"
    text = config.read_text()
    same = run_cli(["train", str(config)])
    assert same.code == 0, same.err
    assert config.read_text() == text
    changed = run_cli(["train", str(config), "train.save_every=1"])
    assert changed.code == 2, changed
    assert str(config) in changed.err and "input config" in changed.err
    assert config.read_text() == text


@pytest.mark.parametrize("name", ["../../x", "a/b", "x" * 300, ".", "..", "", "bad name"])
def test_run_name_is_a_name(
    name: str, tiny_llama_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch
) -> None:
    work = tmp_path / "w" / "v"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    result = run_cli(args(tiny_llama_dir, chat_file, None, f"run.name={name}"))
    assert result.code == 2, result
    assert "run.name" in result.err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["chat.jsonl", "v", "w"]


def test_a_run_dir_component_longer_than_the_filesystem_allows_is_refused(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    result = run_cli(args(tiny_llama_dir, chat_file, tmp_path / ("y" * 300)))
    assert result.code == 2 and "run.dir" in result.err and "255" in result.err, result


def test_failed_starts_leave_no_run_directory_behind(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    fresh = tmp_path / "new" / "run"
    bad_model = run_cli(args(tmp_path / "no-such-model", chat_file, fresh))
    assert bad_model.code == 2, bad_model
    assert not (tmp_path / "new").exists()
    bad = write_jsonl(tmp_path / "bad.jsonl", ["not json"] * 5)
    bad_data = run_cli(args(tiny_llama_dir, bad, fresh))
    assert bad_data.code == 2 and "bad.jsonl" in bad_data.err, bad_data
    assert not (tmp_path / "new").exists()
    # A folder that existed before keeps existing, and only what this start made is removed.
    existing = tmp_path / "existing"
    existing.mkdir()
    assert run_cli(args(tiny_llama_dir, bad, existing)).code == 2
    assert existing.is_dir() and list(existing.iterdir()) == []


def test_a_corrupt_paused_marker_is_reported_and_the_run_resumes(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    assert run_cli(args(tiny_llama_dir, chat_file, run)).code == 0
    for junk in ("{not json", "[1, 2]"):
        (run / "PAUSED").write_text(junk)
        result = run_cli([*args(tiny_llama_dir, chat_file, run)])
        assert result.code == 0, result
        assert f"{run / 'PAUSED'}" in result.out and "resuming" in result.out
        assert not (run / "PAUSED").exists()


def test_resume_never_will_not_move_the_current_directory_aside(
    tiny_llama_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    assert run_cli(args(tiny_llama_dir, chat_file, run)).code == 0
    contents = snapshot(run)
    monkeypatch.chdir(run)
    result = run_cli(args(tiny_llama_dir, chat_file, Path("."), "run.resume=never"))
    assert result.code == 2 and "current directory" in result.err, result
    assert snapshot(run) == contents and not list(tmp_path.glob("run.old-*"))
