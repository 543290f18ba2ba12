"""Every write leantune makes goes through `leantune.core.writes`.

A full disk anywhere (not only in the checkpoint save) is exit 2 naming the file and the fix,
with what was written before intact; in `train` it still saves a checkpoint when it can and
says where the run resumes. A symbolic link, FIFO or device node where an output goes is
refused, never written through or replaced.

The full disk is a real one where this process may mount a small tmpfs (root, as in CI), so
that every writer meets it, C++ and Rust ones included (`torch.jit.save` must not abort the
process, exit 134). Elsewhere the same tests run with the refusal injected where `writes` hands
a file to the filesystem (`_fsync_file`, `_install_dir`, `_write_all`): the assertions are the
same, only the C++ writers' own reaction goes untested there.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import CliResult, chat_rows, run_cli, tiny_train_args, write_jsonl

import leantune.data.dataset as dataset_module
import leantune.training.recipe as recipe
import leantune.training.state.checkpoint as ck
from leantune.core import writes
from leantune.core.writes import NotARegularFile, WriteRefused, append_text, write_file
from leantune.monitor.metrics import MetricsLog
from leantune.training.run.rundir import lock_run_dir

FILLER = "filler"


# --------------------------------------------------------------------------------------------
# A small disk that can be filled


@pytest.fixture(scope="session")
def tmpfs_mounts(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """Whether this process can mount a tmpfs (probed once; LEANTUNE_TESTS_NO_MOUNT=1 runs the
    fall-back here too)."""
    if os.environ.get("LEANTUNE_TESTS_NO_MOUNT"):
        return False
    probe = tmp_path_factory.mktemp("tmpfs_probe")
    if _mount(probe, 64) is None:
        return False
    _umount(probe)
    return True


def _mount(where: Path, size_kib: int) -> Path | None:
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return where if done.returncode == 0 else None


def _umount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@dataclass
class SmallDisk:
    """A folder on its own small filesystem; `fill` leaves no byte free, `free` undoes it."""

    root: Path
    real: bool
    """A tmpfs; else the refusal is injected into `leantune.core.writes` and the checkpoint save."""
    injected: pytest.MonkeyPatch = field(default_factory=pytest.MonkeyPatch)
    full: bool = False
    code: int = errno.ENOSPC
    """What the injected refusal says (a tmpfs says it itself)."""

    def read_only(self) -> None:
        """Remount it read-only: every write is refused with EROFS."""
        self.code = errno.EROFS
        if not self.real:
            self.fill()
            return
        done = subprocess.run(
            ["mount", "-o", "remount,ro", str(self.root)], capture_output=True, timeout=30
        )
        assert done.returncode == 0, done

    def fill(self) -> None:
        self.full = True
        if self.real:
            fd = os.open(self.root / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                for chunk in (1 << 20, 4096, 512, 1):
                    try:
                        while True:
                            os.write(fd, b"\0" * chunk)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC, exc
            finally:
                os.close(fd)
            return
        for name in ("_fsync_file", "_install_dir", "_write_all"):
            self.injected.setattr(writes, name, self._refusing(getattr(writes, name)))
        self.injected.setattr(ck, "_write_payload", self._refusing(ck._write_payload))

    def free(self) -> None:
        self.full = False
        if self.real:
            (self.root / FILLER).unlink()
        self.injected.undo()

    def _refusing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def refuse(where: Any, *rest: Any) -> Any:
            fd = isinstance(where, int)
            path = Path(os.readlink(f"/proc/self/fd/{where}")) if fd else Path(where)
            if self.full and path.is_relative_to(self.root):
                raise OSError(self.code, os.strerror(self.code), str(path))
            return original(where, *rest)

        return refuse

    def listing(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.name != FILLER)


@pytest.fixture()
def small_disk(tmp_path: Path, tmpfs_mounts: bool) -> Iterator[Callable[[int], SmallDisk]]:
    """`small_disk(size_kib)`: a fresh small disk under tmp_path."""
    made: list[SmallDisk] = []

    def make(size_kib: int = 16384) -> SmallDisk:
        root = tmp_path / f"disk{len(made)}"
        root.mkdir()
        made.append(SmallDisk(root, tmpfs_mounts and _mount(root, size_kib) is not None))
        return made[-1]

    yield make
    for disk in made:
        disk.injected.undo()
        if disk.real:
            _umount(disk.root)


# --------------------------------------------------------------------------------------------
# The helper itself


@pytest.mark.parametrize(
    ("code", "fix"), [(errno.ENOSPC, "free space"), (errno.EROFS, "remount it read-write")]
)
def test_a_full_or_read_only_disk_leaves_the_old_file_and_no_temporary(
    code: int, fix: str, small_disk: Callable[[int], SmallDisk]
) -> None:
    disk = small_disk(256)
    target = disk.root / "summary.json"
    target.write_text("old\n")
    if code == errno.ENOSPC:
        disk.fill()
    else:
        disk.read_only()
    with pytest.raises(WriteRefused) as info:
        write_file(target, "x" * 100_000)
    message = str(info.value)
    assert str(target) in message and os.strerror(code) in message, message
    assert "unchanged" in message and fix in message
    assert info.value.exit_code == 2 and info.value.errno == code
    assert target.read_text() == "old\n"
    assert disk.listing() == ["summary.json"]  # no temporary left beside it


def test_a_failed_append_is_cut_back_to_whole_lines(
    small_disk: Callable[[int], SmallDisk],
) -> None:
    disk = small_disk(256)
    log = disk.root / "metrics.jsonl"
    before = "".join(json.dumps({"step": i, "pad": "x" * 500}) + "\n" for i in range(7))
    log.write_text(before)  # 3.6 kB: the next line needs a new page
    disk.fill()
    with pytest.raises(WriteRefused) as info:
        append_text(log, json.dumps({"step": 7, "pad": "y" * 4000}) + "\n")
    assert str(log) in str(info.value)
    assert log.read_text() == before


@pytest.fixture()
def not_regular(tmp_path: Path) -> Callable[[str], tuple[Path, Callable[[], None]]]:
    """`not_regular(kind)`: a path of that kind, and a check that it was left as it was."""

    def make(kind: str) -> tuple[Path, Callable[[], None]]:
        path = tmp_path / f"out-{kind}"
        if kind == "symlink":
            precious = tmp_path / "precious.txt"
            precious.write_text("keep me\n")
            path.symlink_to(precious)
            return (
                path,
                lambda: (
                    (path.is_symlink() and precious.read_text() == "keep me\n")
                    or pytest.fail("the link or its target changed")
                ),
            )
        if kind == "fifo":
            os.mkfifo(path)
            return path, lambda: stat.S_ISFIFO(os.lstat(path).st_mode) or pytest.fail("replaced")
        if kind == "device":
            if os.geteuid() == 0:  # the node of /dev/full, made here
                os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
            else:  # only root can make one, and only root could replace /dev/null
                path = Path("/dev/null")
            return path, lambda: stat.S_ISCHR(os.lstat(path).st_mode) or pytest.fail("replaced")
        path.mkdir()
        (path / "inside").write_text("x")
        return path, lambda: (path / "inside").read_text() == "x" or pytest.fail("changed")

    return make


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device", "folder"])
def test_writes_refuse_what_is_not_a_regular_file(
    kind: str, not_regular: Callable[[str], tuple[Path, Callable[[], None]]]
) -> None:
    path, unchanged = not_regular(kind)
    for write in (lambda: write_file(path, "new\n"), lambda: append_text(path, "new\n")):
        with pytest.raises(NotARegularFile) as info:
            write()
        assert str(path) in str(info.value) and info.value.exit_code == 2
        unchanged()


def test_the_run_dir_lock_is_never_taken_through_a_link(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".leantune.lock").symlink_to(precious)
    with pytest.raises(NotARegularFile) as info:
        lock_run_dir(run)  # never writes its pid into the link's target
    assert str(run / ".leantune.lock") in str(info.value)
    assert precious.read_text() == "keep me\n"


# --------------------------------------------------------------------------------------------
# Through the commands


@dataclass
class World:
    model: Path
    chat: Path
    finished: Path

    def args(self, run: Path, *extra: str) -> list[str]:
        return tiny_train_args(
            self.model, self.chat, run, "train.max_steps=2", "train.save_every=2", *extra
        )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> World:
    base = tmp_path_factory.mktemp("writes")
    chat = write_jsonl(base / "chat.jsonl", chat_rows(24))
    w = World(tiny_llama_dir, chat, base / "finished")
    assert run_cli(w.args(w.finished)).code == 0
    return w


def _no_traceback_exit_2(result: CliResult, *named: str) -> None:
    assert result.code == 2, result
    for text in named:
        assert text in result.err, (text, result.err)


def test_train_on_a_disk_that_fills_between_saves_exits_2_naming_the_file_and_resume_point(
    world: World,
    small_disk: Callable[[int], SmallDisk],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    disk = small_disk(16384)
    run = disk.root / "run"
    original = recipe._after_update

    def after_update(tr: Any, *rest: Any) -> None:
        original(tr, *rest)
        if tr.state.step == 1:
            disk.fill()  # another process took the rest of the disk

    monkeypatch.setattr(recipe, "_after_update", after_update)
    args = world.args(run, "train.max_steps=12", "train.save_every=12")
    result = run_cli(args)
    _no_traceback_exit_2(result, str(run / "metrics.jsonl"), "No space left on device")
    assert "no checkpoint" in result.err and "starts over" in result.err, result.err
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, len(lines) + 1))
    disk.free()
    monkeypatch.setattr(recipe, "_after_update", original)
    again = run_cli(args)
    assert again.code == 0, again
    assert json.loads((run / "summary.json").read_text())["steps"] == 12


def test_train_saves_a_checkpoint_when_a_log_write_fails_and_resumes_from_it(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    original = MetricsLog.write

    def write(log: MetricsLog, record: dict[str, Any]) -> None:
        if log.path.name == "metrics.jsonl" and record["step"] == 3:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(log.path))
        original(log, record)

    monkeypatch.setattr(MetricsLog, "write", write)
    args = world.args(run, "train.max_steps=4", "train.save_every=4")
    result = run_cli(args)
    _no_traceback_exit_2(result, str(run / "metrics.jsonl"), "quota")
    assert str(run / "checkpoints" / "step-000003") in result.err, result.err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000003"]
    monkeypatch.undo()
    again = run_cli(args)
    assert again.code == 0, again
    assert "resumed from" in again.out and "step-000003" in again.out


def test_train_own_data_preparation_on_a_full_disk_exits_2_and_leaves_nothing(
    world: World, small_disk: Callable[[int], SmallDisk], monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = small_disk(16384)
    run = disk.root / "run"
    original = dataset_module.prepare_dataset

    def prepare(*args: Any, **kwargs: Any) -> Any:
        disk.fill()
        return original(*args, **kwargs)

    monkeypatch.setattr(dataset_module, "prepare_dataset", prepare)
    result = run_cli(world.args(run))
    _no_traceback_exit_2(result, str(run / "prepared"), "No space left on device")
    assert disk.listing() == []  # the failed start removed the run directory it made


def test_prepare_on_a_full_disk_exits_2_and_keeps_the_earlier_output(
    world: World, small_disk: Callable[[int], SmallDisk]
) -> None:
    disk = small_disk(16384)
    out = disk.root / "prepared"
    args = [
        "prepare", "--data", str(world.chat), "--format", "chat", "--model", str(world.model),
        "--out", str(out), "--dedup", "none", "--clean", "none",
    ]  # fmt: skip
    assert run_cli(args).code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    disk.fill()
    result = run_cli([*args, "--force"])
    _no_traceback_exit_2(result, str(out), "No space left on device")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [n for n in disk.listing() if ".tmp-" in n] == []


@pytest.mark.parametrize(
    "fmt",
    [
        "torchscript",
        "hf",
        "int8",  # torch.jit.save aborted here too (exit 134)
        pytest.param("gguf", marks=pytest.mark.slow),
        pytest.param("adapter", marks=pytest.mark.slow),
    ],
)
def test_export_on_a_full_disk_exits_2_and_keeps_the_earlier_export(
    fmt: str, world: World, small_disk: Callable[[int], SmallDisk]
) -> None:
    disk = small_disk(16384)
    out = disk.root / "export"
    args = ["export", str(world.finished), "--format", fmt, "--out", str(out), "--samples", "1"]
    assert run_cli(args).code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    disk.fill()
    result = run_cli(args)  # torchscript: torch.jit.save must not abort the process (134)
    _no_traceback_exit_2(result, str(out), "No space left on device")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert disk.listing() == ["export"]


def test_report_on_a_full_disk_exits_2_and_keeps_the_earlier_report(
    world: World, small_disk: Callable[[int], SmallDisk]
) -> None:
    disk = small_disk(16384)
    run = disk.root / "run"
    shutil.copytree(world.finished, run)
    before = (run / "report.html").read_bytes()
    disk.fill()
    result = run_cli(["report", str(run)])
    _no_traceback_exit_2(result, str(run / "report.html"), "No space left on device")
    assert (run / "report.html").read_bytes() == before


# --------------------------------------------------------------------------------------------
# Links, FIFOs and devices through the commands


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device"])
def test_report_out_refuses_what_is_not_a_regular_file(
    kind: str, world: World, not_regular: Callable[[str], tuple[Path, Callable[[], None]]]
) -> None:
    path, unchanged = not_regular(kind)
    result = run_cli(["report", str(world.finished), "--out", str(path)])
    _no_traceback_exit_2(result, str(path))
    unchanged()


def test_a_symlinked_metrics_file_is_refused_and_its_target_kept(
    world: World, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(world.finished, run)
    precious = tmp_path / "precious.jsonl"
    precious.write_text('{"mine": 1}\n' * 50)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(precious)
    result = run_cli(world.args(run))
    _no_traceback_exit_2(result, str(run / "metrics.jsonl"), "symbolic link")
    assert precious.read_text() == '{"mine": 1}\n' * 50


def test_a_symlinked_run_dir_with_resume_never_is_put_back_when_the_start_fails(
    world: World, tmp_path: Path
) -> None:
    real = tmp_path / "real"
    shutil.copytree(world.finished, real)
    link = tmp_path / "link"
    link.symlink_to(real)
    before = sorted(p.name for p in real.iterdir())
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"messages": "not a list"}'] * 3)
    args = tiny_train_args(world.model, bad, link, "run.resume=never", "train.max_steps=1")
    result = run_cli(args)
    assert result.code == 2 and "3 of 3 lines are bad" in result.err, result
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in real.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "link", "real"]
    # The same start with good data moves the old run aside and trains in the link's folder.
    result = run_cli(world.args(link, "run.resume=never", "train.max_steps=1"))
    assert result.code == 0, result
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("real.old-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == before
    assert json.loads((real / "summary.json").read_text())["steps"] == 1
