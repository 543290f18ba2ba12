"""The CPU allocator: the `leantune` command re-executes itself with tcmalloc preloaded where it
is installed, says so in its log, keeps an allocator the user preloaded, refuses a wrong
LEANTUNE_ALLOCATOR before anything runs, and the benchmark's baseline never inherits it.

tcmalloc must be installed for the end-to-end tests (Debian: libtcmalloc-minimal4; `.ci/run`
installs it): a test that skipped without it would never run in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import chat_rows, tiny_train_args, write_jsonl

from leantune.core.allocator import (
    ENV,
    MARK,
    allocator_note,
    find_tcmalloc,
    library_dirs,
    preload_for,
    preloaded_environment,
    without_leantune_preload,
)
from leantune.errors import UserError


def _fake_lib(folder: Path, name: str = "libtcmalloc_minimal.so.4") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(b"\x7fELF")
    return folder / name


def test_auto_takes_tcmalloc_where_found_and_glibc_where_not(tmp_path: Path) -> None:
    lib = _fake_lib(tmp_path / "lib")
    assert preload_for({}, [tmp_path / "empty", tmp_path / "lib"]) == lib
    assert preload_for({ENV: "auto"}, [tmp_path / "lib"]) == lib
    assert preload_for({ENV: "TCMalloc"}, [tmp_path / "lib"]) == lib
    assert preload_for({}, [tmp_path / "empty"]) is None  # glibc's, with a hint in the log
    assert preload_for({ENV: "system"}, [tmp_path / "lib"]) is None


def test_an_allocator_the_user_preloaded_is_left_alone(tmp_path: Path) -> None:
    dirs = [tmp_path / "lib"]
    _fake_lib(dirs[0])
    for theirs in ("/opt/lib/libjemalloc.so.2", "/x/libtcmalloc.so.4:/y/libfoo.so"):
        assert preload_for({"LD_PRELOAD": theirs}, dirs) is None
    # An unrelated preload does not stop ours; ours goes first and theirs stays.
    env = preloaded_environment({"LD_PRELOAD": "/y/libfoo.so"}, dirs[0] / "x.so")
    assert env["LD_PRELOAD"] == f"{dirs[0] / 'x.so'}:/y/libfoo.so"


def test_a_wrong_setting_is_refused_naming_the_variable_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=rf"{ENV}='jemallocc': must be one of auto, tcmalloc"):
        preload_for({ENV: "jemallocc"}, [])
    with pytest.raises(UserError) as e:
        preload_for({ENV: "tcmalloc"}, [tmp_path / "nothing-here"])
    assert str(tmp_path / "nothing-here") in str(e.value)
    assert "apt-get install libtcmalloc-minimal4" in str(e.value) and f"{ENV}=auto" in str(e.value)


def test_the_search_covers_the_environment_and_the_system_folders(tmp_path: Path) -> None:
    dirs = library_dirs({"VIRTUAL_ENV": str(tmp_path / "venv"), "CONDA_PREFIX": str(tmp_path)})
    assert dirs[:2] == [tmp_path / "lib", tmp_path / "venv" / "lib"]
    assert Path("/usr/lib") in dirs and Path("/usr/lib64") in dirs
    lib = _fake_lib(tmp_path / "venv" / "lib", "libtcmalloc.so.4")
    assert find_tcmalloc(dirs) == lib


def test_the_baseline_gets_the_environment_without_our_preload() -> None:
    ours = "/usr/lib/libtcmalloc_minimal.so.4"
    env = preloaded_environment({"LD_PRELOAD": "/y/libfoo.so", "PATH": "/bin"}, Path(ours))
    assert env[MARK] == ours
    assert without_leantune_preload(env) == {
        "LD_PRELOAD": "/y/libfoo.so",
        "PATH": "/bin",
        "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"],
    }
    alone = without_leantune_preload(preloaded_environment({}, Path(ours)))
    assert "LD_PRELOAD" not in alone and MARK not in alone
    assert without_leantune_preload({"LD_PRELOAD": "/z/libjemalloc.so"}) == {
        "LD_PRELOAD": "/z/libjemalloc.so"
    }


def test_the_note_reports_what_the_process_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = _fake_lib(tmp_path / "lib")
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        f"7f02-7f03 r-xp 00000000 08:01 2 {lib}\n"
    )
    monkeypatch.setenv(MARK, str(lib))
    assert allocator_note(maps) == f"allocator: tcmalloc ({lib}; {ENV}=system for glibc's)"
    monkeypatch.delenv(MARK)
    assert allocator_note(maps) == f"allocator: tcmalloc ({lib}; preloaded by you (LD_PRELOAD))"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator_note(maps).startswith("allocator: glibc's malloc; install tcmalloc")
    monkeypatch.setenv(ENV, "system")
    assert allocator_note(maps) == f"allocator: glibc's malloc ({ENV}=system)"


def _train(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in (ENV, MARK, "LD_PRELOAD")}
    environ.update(env, HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "leantune", *args]
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=300)


def test_the_leantune_command_trains_with_tcmalloc_and_says_so(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    assert find_tcmalloc(library_dirs(os.environ)), (
        "tcmalloc is not installed: apt-get install libtcmalloc-minimal4 (.ci/run does)"
    )
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    done = _train(tiny_train_args(tiny_llama_dir, train, tmp_path / "t", "train.max_steps=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "allocator: tcmalloc (/" in log and f"{ENV}=system for glibc's" in log
    assert "tcmalloc: large alloc" not in log
    assert json.loads((tmp_path / "t" / "summary.json").read_text())["allocator"] == "tcmalloc"
    run = tiny_train_args(tiny_llama_dir, train, tmp_path / "s", "train.max_steps=2")
    done = _train(run, **{ENV: "system"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"allocator: glibc's malloc ({ENV}=system)" in done.stdout + done.stderr
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["allocator"] == "glibc"


def test_a_wrong_allocator_setting_stops_the_command_before_it_runs(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    done = _train(tiny_train_args(tiny_llama_dir, train, tmp_path / "run"), **{ENV: "glibc"})
    assert done.returncode == 2
    assert f"error: {ENV}='glibc': must be one of auto, tcmalloc, system" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
