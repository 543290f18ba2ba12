"""Every user mistake leantune promises to catch, through the command line, in one table.

Each case sets up what a user (or an attacker) did, runs `leantune ...` in this process and
asserts the exit code, that the message names what it must (the field, the file, the pid), that
no Python traceback was printed (`run_cli` checks that) and, where files are at stake, that
nothing was lost. The focused tests of each behaviour live beside the code's own tests
(test_resume_policy, test_run_dir, test_signals, test_checkpoint_integrity, test_prepare_errors,
test_cli_errors, test_config); this file keeps the whole list in one place, as README's "What
leantune promises" lists it.
"""

from __future__ import annotations

import errno
import fcntl
import gzip
import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from support import CliResult, run_cli, save_tiny_model, write_jsonl

import leantune.training.state.checkpoint as ck
from leantune.monitor.metrics import read_metrics
from leantune.testing.faults import SIGNAL_ENV
from leantune.training.state.checkpoint import MARKER, load_checkpoint


def chat_rows(n: int, offset: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Order {i}: where is it?"},
                {"role": "assistant", "content": json.dumps({"order": i, "status": "sent"})},
            ]
        }
        for i in range(offset, offset + n)
    ]


def alpaca_rows(n: int) -> list[dict[str, Any]]:
    return [{"instruction": f"Say {i}.", "output": f"{i}"} for i in range(n)]


@dataclass
class Env:
    """What a case starts from: tiny models, data files and a finished run to copy."""

    tmp: Path
    model: Path
    other_model: Path
    chat: Path
    finished: Path
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    saved: dict[str, bytes] = field(default_factory=dict)
    """Files a case must leave as they were."""

    def args(self, run: Path, *extra: str, data: Path | None = None) -> list[str]:
        """`leantune train` on the tiny model: 4 steps, checkpoints at 2 and 4."""
        return [
            "train", f"model.path={self.model}", f"data.train={data or self.chat}",
            "data.eval=null", "data.max_seq_len=128", "train.eval_exact_match=false",
            "train.micro_batch_size=2", "train.max_steps=4", "train.save_every=2",
            "train.keep_last=2", "train.lr=1e-2", "train.seed=3", f"run.dir={run}",
            "run.progress=false", *extra,
        ]  # fmt: skip

    def run_copy(self) -> Path:
        """A copy of the finished run, for a case to resume, damage or export."""
        run = self.tmp / "run"
        shutil.copytree(self.finished, run, symlinks=True)
        return run


@dataclass(frozen=True)
class Case:
    setup: Callable[[Env], list[str]]
    """Prepares the files and returns the command's arguments."""
    code: int
    needles: tuple[str, ...] = ()
    """Each must appear in what the command printed."""
    check: Callable[[Env, CliResult], None] | None = None
    """Further assertions (nothing lost, the right state written)."""


# ---------------------------------------------------------------------------------------------
# 1. A run is what its config says


def resumed_with(*extra: str) -> Callable[[Env], list[str]]:
    def setup(env: Env) -> list[str]:
        return env.args(env.run_copy(), *extra)

    return setup


def other_base(env: Env) -> list[str]:
    args = env.args(env.run_copy())
    return [a.replace(str(env.model), str(env.other_model)) for a in args]


def other_data(env: Env) -> list[str]:
    data = write_jsonl(env.tmp / "other.jsonl", chat_rows(24, offset=500))
    return env.args(env.run_copy(), data=data)


def other_format(env: Env) -> list[str]:
    data = write_jsonl(env.tmp / "alpaca.jsonl", alpaca_rows(24))
    return env.args(env.run_copy(), "data.format=alpaca", data=data)


def chat_then_alpaca(*name: str) -> Callable[[Env], list[str]]:
    """The README's example command twice, with a chat file, then an alpaca file, in
    runs/<run.name> (`name` = run.name=..., or nothing for the default name)."""

    def setup(env: Env) -> list[str]:
        os.chdir(env.tmp)
        first = [a for a in env.args(env.tmp / "x", *name) if not a.startswith("run.dir=")]
        assert run_cli(first).code == 0
        (run,) = (env.tmp / "runs").iterdir()
        final = run / "final" / "adapter_model.safetensors"
        env.saved = {
            "run": str(run).encode(),
            "final": final.read_bytes(),
            "config": (run / "config.yaml").read_bytes(),
        }
        data = write_jsonl(env.tmp / "alpaca.jsonl", alpaca_rows(24))
        second = env.args(env.tmp / "x", *name, data=data)
        return [*(a for a in second if not a.startswith("run.dir=")), "data.format=alpaca"]

    return setup


def final_unchanged(env: Env, result: CliResult) -> None:
    run = Path(env.saved["run"].decode())
    assert (run / "final" / "adapter_model.safetensors").read_bytes() == env.saved["final"]
    assert (run / "config.yaml").read_bytes() == env.saved["config"]


def two_run_dirs(env: Env, result: CliResult) -> None:
    runs = sorted(p.name for p in (env.tmp / "runs").iterdir())
    assert [r.split("-")[0] for r in runs] == ["alpaca", "chat"], runs
    final_unchanged(env, result)


def old_run_moved_aside(env: Env, result: CliResult) -> None:
    (aside,) = [p for p in env.tmp.iterdir() if p.name.startswith("run.old-")]
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == [
        "step-000002",
        "step-000004",
    ]
    metrics = read_metrics(env.tmp / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # the new run, alone


def lr_has_no_jump(env: Env, result: CliResult) -> None:
    lrs = [m["lr"] for m in read_metrics(env.tmp / "run" / "metrics.jsonl")]
    assert len(lrs) == 8
    continued = lrs[3:]  # the LR of step 4, then the added steps
    assert all(b <= a for a, b in itertools.pairwise(continued)), lrs


# ---------------------------------------------------------------------------------------------
# 2. A run directory belongs to one run


def lock_held(env: Env) -> list[str]:
    run = env.run_copy()
    fd = os.open(run / ".leantune.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\n".encode())
    env.cleanups.append(lambda: os.close(fd))
    return env.args(run)


def not_a_run(env: Env) -> list[str]:
    folder = env.tmp / "mine"
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "important.txt").write_text("keep me")
    (folder / "config.yaml").write_text("mine: true\n")
    return env.args(folder)


def folder_untouched(env: Env, result: CliResult) -> None:
    folder = env.tmp / "mine"
    assert (folder / "final" / "important.txt").read_text() == "keep me"
    assert (folder / "config.yaml").read_text() == "mine: true\n"
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "final"]


def run_dir_dot(env: Env) -> list[str]:
    folder = env.tmp / "project"
    folder.mkdir()
    config = folder / "my.yaml"
    config.write_text(f"model:\n  path: {env.model}\nrun:\n  dir: .\n")
    args = [a for a in env.args(folder) if not a.startswith(("run.dir=", "model.path="))]
    os.chdir(folder)
    return ["train", str(config), *args[1:]]


def config_untouched(env: Env, result: CliResult) -> None:
    config = env.tmp / "project" / "my.yaml"
    assert config.read_text() == f"model:\n  path: {env.model}\nrun:\n  dir: .\n"


def failed_start(env: Env) -> list[str]:
    return env.args(env.tmp / "fresh", f"model.path={env.tmp / 'no-such-model'}")


def no_dir_left(env: Env, result: CliResult) -> None:
    assert not (env.tmp / "fresh").exists()


# ---------------------------------------------------------------------------------------------
# 3. Checkpoints: integrity


def zero_middle(file: Path, count: int = 60_000) -> None:
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.seek(size // 2 - count // 2)
        f.write(b"\0" * count)


def remark(path: Path) -> None:
    """What someone who edited a file and re-marked the checkpoint would do."""
    manifest = json.loads((path / MARKER).read_text())
    for name in manifest["files"]:
        data = (path / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MARKER).write_text(json.dumps(manifest))


def zeros_in_newest(env: Env) -> list[str]:
    run = env.run_copy()
    zero_middle(run / "checkpoints" / "step-000004" / "model.safetensors")
    return env.args(run)


def redone_bit_exact(env: Env, result: CliResult) -> None:
    want = load_checkpoint(env.finished / "checkpoints" / "step-000004").weights
    got = load_checkpoint(env.tmp / "run" / "checkpoints" / "step-000004").weights
    assert all(torch.equal(got[k], w) for k, w in want.items())


def negative_samples_seen(env: Env) -> list[str]:
    run = env.run_copy()
    for step in ("step-000002", "step-000004"):
        state_file = run / "checkpoints" / step / "trainer_state.json"
        state = json.loads(state_file.read_text())
        state["extra"]["batching"]["samples_seen"] = -7
        state_file.write_text(json.dumps(state))
        remark(state_file.parent)
    return env.args(run)


def every_checkpoint_damaged(env: Env) -> list[str]:
    run = env.run_copy()
    zero_middle(run / "checkpoints" / "step-000004" / "model.safetensors")
    (run / "checkpoints" / "step-000002" / "optimizer.pt").write_bytes(b"cut")
    return env.args(run)


def checkpoints_kept(env: Env, result: CliResult) -> None:
    ckpts = env.tmp / "run" / "checkpoints"
    assert (ckpts / "step-000002" / "optimizer.pt").read_bytes() == b"cut"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002", "step-000004"]


class _Evil:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def swapped_pickle(env: Env) -> list[str]:
    run = env.run_copy()
    for step in ("step-000002", "step-000004"):
        path = run / "checkpoints" / step
        state = {"scheduler": _Evil(env.tmp / "pwned"), "scaler": None, "rng": {}}
        torch.save(state, path / "trainer_state.pt")
        remark(path)
    return env.args(run)


def never_unpickled(env: Env, result: CliResult) -> None:
    assert not (env.tmp / "pwned").exists()
    assert "weights_only=False" not in result.err and "likely succeed" not in result.err


# ---------------------------------------------------------------------------------------------
# 4. Signals


def signal_at(spec: str) -> Callable[[Env], list[str]]:
    def setup(env: Env) -> list[str]:
        os.environ[SIGNAL_ENV] = spec
        env.cleanups.append(lambda: os.environ.pop(SIGNAL_ENV, None))
        return env.args(env.tmp / "run", "train.save_every=0")

    return setup


def resumes_to_the_same_weights(env: Env, result: CliResult) -> None:
    run = env.tmp / "run"
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    # Micro-batch 2 is step 3's only one: the signal lands after its backward, the step is
    # applied, and the checkpoint holds step 3 (test_signals abandons a window half-way).
    assert saved == ["step-000003"], saved
    os.environ.pop(SIGNAL_ENV, None)
    again = run_cli(env.args(run, "train.save_every=0"))
    assert again.code == 0, again
    want = load_checkpoint(env.finished / "checkpoints" / "step-000004").weights
    got = load_checkpoint(run / "checkpoints" / "step-000004").weights
    assert all(torch.equal(got[k], w) for k, w in want.items())


# ---------------------------------------------------------------------------------------------
# 5 and 6. Input


def with_bad_record(line: Callable[[], str]) -> Callable[[Env], list[str]]:
    def setup(env: Env) -> list[str]:
        path = env.tmp / "data.jsonl"
        write_jsonl(path, [*chat_rows(23), line()])
        return env.args(env.tmp / "run", data=path)

    return setup


def long_chat() -> str:
    turns = [
        {"role": r, "content": f"turn {i}"} for i in range(2000) for r in ("user", "assistant")
    ]
    return json.dumps({"messages": turns})


def fifty_mb_line() -> str:
    user = {"role": "user", "content": "a" * 50_000_000}
    return json.dumps({"messages": [user, {"role": "assistant", "content": "ok"}]})


def deep_json() -> str:
    return "[" * 100_000 + "]" * 100_000


def truncated_gz(env: Env) -> list[str]:
    raw = "".join(json.dumps(r) + "\n" for r in chat_rows(400)).encode()
    packed = gzip.compress(raw)
    path = env.tmp / "data.jsonl.gz"
    path.write_bytes(packed[: len(packed) // 2])
    return env.args(env.tmp / "run", data=path)


def tiny_parquet(env: Env) -> list[str]:
    path = env.tmp / "data.parquet"
    path.write_bytes(b"PAR1x")
    return env.args(env.tmp / "run", data=path)


def eval_args(env: Env, *extra: str) -> list[str]:
    data = write_jsonl(env.tmp / "eval.jsonl", chat_rows(5, offset=900))
    return ["eval", "--model", str(env.finished / "final"), "--data", str(data), *extra]


def eval_on_directory(env: Env) -> list[str]:
    return ["eval", "--model", str(env.finished / "final"), "--data", str(env.tmp)]


def export_without_final(env: Env) -> list[str]:
    run = env.run_copy()
    shutil.rmtree(run / "final")
    return ["export", str(run), "--format", "hf", "--out", str(env.tmp / "out")]


def corrupt_paused(env: Env) -> list[str]:
    run = env.run_copy()
    (run / "PAUSED").write_text("{not json")
    return env.args(run)


def symlinked_tmp(env: Env) -> list[str]:
    run = env.run_copy()
    shutil.rmtree(run / "checkpoints" / "step-000004")
    target = env.tmp / "target"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (run / "checkpoints" / ".tmp-step-000003-1").symlink_to(target, target_is_directory=True)
    return env.args(run)


def target_kept(env: Env, result: CliResult) -> None:
    assert (env.tmp / "target" / "notes.txt").read_text() == "mine"


def disk_error(code: int) -> Callable[[Env], list[str]]:
    def setup(env: Env) -> list[str]:
        original = ck._write_payload

        def payload(directory: Path, *rest: Any) -> Any:
            if directory.name.startswith(".tmp-step-000004"):
                raise OSError(code, os.strerror(code), str(directory / "model.safetensors"))
            return original(directory, *rest)

        ck._write_payload = payload  # type: ignore[assignment]
        env.cleanups.append(lambda: setattr(ck, "_write_payload", original))
        return env.args(env.tmp / "run")

    return setup


def step_2_is_the_resume_point(env: Env, result: CliResult) -> None:
    saved = sorted(p.name for p in (env.tmp / "run" / "checkpoints").iterdir())
    assert saved == ["step-000002"], saved


def bom_file(env: Env) -> list[str]:
    path = env.tmp / "data.jsonl"
    write_jsonl(path, chat_rows(24))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    return prepare_args(env, path)


def prepare_args(env: Env, path: Path) -> list[str]:
    return [
        "prepare", "--data", str(path), "--format", "chat", "--model", str(env.model),
        "--out", str(env.tmp / "prepared"), "--dedup", "none", "--clean", "none",
    ]  # fmt: skip


def all_24_kept(env: Env, result: CliResult) -> None:
    report = json.loads((env.tmp / "prepared" / "prepare_report.json").read_text())
    assert (report["rows_in"], report["rows_out"]) == (24, 24)


def nothing_kept(env: Env) -> list[str]:
    path = write_jsonl(env.tmp / "data.jsonl", ['{"messages": []}', "{oops", "[1, 2]"])
    return prepare_args(env, path)


def duplicated_key(env: Env) -> list[str]:
    config = env.tmp / "dup.yaml"
    config.write_text("train:\n  lr: 1.0e-4\n  max_steps: 3\n  lr: 5.0e-3\n")
    return ["validate", str(config)]


def diverging(env: Env) -> list[str]:
    return env.args(env.tmp / "run", "train.weight_decay=1e300")


def no_nan_checkpoint(env: Env, result: CliResult) -> None:
    assert "resumes" not in result.err
    ckpts = env.tmp / "run" / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())


CASES: dict[str, Case] = {
    # 1. A run is what its config says
    "resume with another train.lr": Case(
        resumed_with("train.lr=5e-3"), 2, ("train.lr: 0.01 -> 0.005", "run.resume=force")
    ),
    "resume onto another base with the same shapes": Case(other_base, 2, ("model.",)),
    "resume with other data": Case(other_data, 2, ("data.train",)),
    "resume with another format": Case(other_format, 2, ("data.format: chat -> alpaca",)),
    "resume with another seed": Case(resumed_with("train.seed=4"), 2, ("train.seed: 3 -> 4",)),
    "resume with another global batch": Case(
        resumed_with("train.grad_accum=2"), 2, ("train.global_batch: 2 -> 4",)
    ),
    "force onto another LoRA rank": Case(
        resumed_with("method.r=4", "run.resume=force"), 2, ("method.r", "even with")
    ),
    "force onto another method": Case(
        resumed_with("method.name=ia3", "run.resume=force"), 2, ("method.name", "even with")
    ),
    "a chat file, then an alpaca file, in the same named run dir": Case(
        chat_then_alpaca("run.name=mine"),
        2,
        ("data.format: chat -> alpaca", "run.name"),
        final_unchanged,
    ),
    "a chat file, then an alpaca file, without run.name: two run dirs": Case(
        chat_then_alpaca(), 0, ("run directory: runs/alpaca-lora-",), two_run_dirs
    ),
    "run.resume=never over an older run": Case(
        resumed_with("run.resume=never"), 0, ("moved",), old_run_moved_aside
    ),
    "a raised train.max_steps without force": Case(
        resumed_with("train.max_steps=8"), 2, ("train.max_steps: 4 -> 8",)
    ),
    "a raised train.max_steps with force": Case(
        resumed_with("train.max_steps=8", "run.resume=force"),
        0,
        ("train.max_steps",),
        lr_has_no_jump,
    ),
    # 2. A run directory belongs to one run
    "a second process on a locked run dir": Case(lock_held, 2, (f"pid {os.getpid()}",)),
    "run.dir is someone's folder": Case(not_a_run, 2, ("not a leantune run",), folder_untouched),
    "run.dir: . next to the input config": Case(run_dir_dot, 2, ("run.dir",), config_untouched),
    "run.name with a path": Case(
        lambda env: env.args(env.tmp / "r", "run.name=../../x", "run.dir=null"), 2, ("run.name",)
    ),
    "a 300-character run.name": Case(
        lambda env: env.args(env.tmp / "r", f"run.name={'a' * 300}", "run.dir=null"),
        2,
        ("run.name",),
    ),
    "a failed start": Case(failed_start, 2, ("no-such-model",), no_dir_left),
    # 3. Checkpoints: integrity
    "zeros written into the newest weights": Case(
        zeros_in_newest, 0, ("step-000004", "sha256", "resumed from"), redone_bit_exact
    ),
    "a hand-edited samples_seen=-7": Case(negative_samples_seen, 2, ("samples_seen", "-7")),
    "every checkpoint damaged": Case(
        every_checkpoint_damaged,
        2,
        ("step-000002", "step-000004", "run.resume=never"),
        checkpoints_kept,
    ),
    "a refused pickle": Case(swapped_pickle, 2, ("never unpickles",), never_unpickled),
    # 4. Signals
    "SIGTERM mid-step": Case(signal_at("2:TERM"), 143, ("SIGTERM",), resumes_to_the_same_weights),
    "SIGINT mid-step": Case(signal_at("2:INT"), 130, ("SIGINT",), resumes_to_the_same_weights),
    # 5. Input that must not take the machine down
    "a 2,000-turn record": Case(with_bad_record(long_chat), 0, ("data.jsonl:24: too long",)),
    "a 50 MB line": Case(with_bad_record(fifty_mb_line), 0, ("data.jsonl:24: too long",)),
    # 6. Bad input
    "100k-deep nested JSON": Case(with_bad_record(deep_json), 0, ("data.jsonl:24", "nested")),
    "a truncated .jsonl.gz": Case(truncated_gz, 2, ("data.jsonl.gz",)),
    "a 5-byte .parquet": Case(tiny_parquet, 2, ("data.parquet", "not a Parquet file")),
    "eval on a directory": Case(eval_on_directory, 2, ("--data",)),
    "eval --batch-size 0": Case(
        lambda env: eval_args(env, "--batch-size", "0"), 2, ("--batch-size",)
    ),
    "eval --limit -1": Case(lambda env: eval_args(env, "--limit", "-1"), 2, ("--limit",)),
    "export of a run without final/": Case(export_without_final, 2, ("final",)),
    "a corrupt PAUSED marker": Case(corrupt_paused, 0, ("PAUSED",)),
    "a symlinked .tmp-* checkpoint": Case(symlinked_tmp, 0, ("resumed from",), target_kept),
    "ENOSPC while saving": Case(
        disk_error(errno.ENOSPC), 2, ("No space left on device",), step_2_is_the_resume_point
    ),
    "EROFS while saving": Case(
        disk_error(errno.EROFS), 2, ("Read-only file system",), step_2_is_the_resume_point
    ),
    "a UTF-8 BOM": Case(bom_file, 0, (), all_24_kept),
    "prepare keeps 0 rows": Case(nothing_kept, 2, ("kept 0 of 3", "rejected.jsonl")),
    "train.weight_decay=.inf": Case(
        lambda env: env.args(env.tmp / "r", "train.weight_decay=.inf"), 2, ("train.weight_decay",)
    ),
    "train.max_grad_norm=.nan": Case(
        lambda env: env.args(env.tmp / "r", "train.max_grad_norm=.nan"), 2, ("train.max_grad_norm",)
    ),
    "train.kl_coef=.nan": Case(
        lambda env: env.args(env.tmp / "r", "train.kl_coef=.nan"), 2, ("train.kl_coef",)
    ),
    "a duplicated YAML key": Case(duplicated_key, 2, ("dup.yaml:4: train.lr", "line 2")),
    "weights that diverge": Case(diverging, 4, ("diverged",), no_nan_checkpoint),
    # Found while fixing the above: settings only the model's shape can check, and prepare's flags
    "method.last_blocks beyond the model's blocks": Case(
        lambda env: env.args(env.tmp / "r", "method.name=freeze", "method.last_blocks=5"),
        2,
        ("method.last_blocks=5", "only 2 blocks"),
        lambda env, result: no_dir_left_at(env.tmp / "r"),
    ),
    "method.adapter_reduction beyond the hidden size": Case(
        lambda env: env.args(env.tmp / "r", "method.name=adapter", "method.adapter_reduction=1000"),
        2,
        ("method.adapter_reduction=1000", "1..64"),
    ),
    "prepare --near-dup-threshold nan": Case(
        lambda env: [*prepare_args(env, env.chat), "--near-dup-threshold", "nan"],
        2,
        ("--near-dup-threshold", "finite"),
    ),
    "prepare --min-tokens -1": Case(
        lambda env: [*prepare_args(env, env.chat), "--min-tokens", "-1"], 2, ("data.min_tokens",)
    ),
    "prepare --clean with an unknown rule": Case(
        lambda env: [*prepare_args(env, env.chat), "--clean", "html,bogus"], 2, ("--clean", "bogus")
    ),
    "prepare --workers 0": Case(
        lambda env: [*prepare_args(env, env.chat), "--workers", "0"], 2, ("--workers",)
    ),
}


def no_dir_left_at(path: Path) -> None:
    assert not path.exists()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("promises")
    model = save_tiny_model(base / "model", "llama", tokenizer_dir)
    other = save_tiny_model(base / "other", "llama", tokenizer_dir, seed=1)
    chat = write_jsonl(base / "chat.jsonl", chat_rows(24))
    env = Env(base, model, other, chat, base / "finished")
    result = run_cli(env.args(env.finished))
    assert result.code == 0, result
    yield env


@pytest.mark.parametrize("name", list(CASES))
def test_every_mistake_is_a_clear_message_and_exit_code(
    name: str, world: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    monkeypatch.chdir(tmp_path)
    env = Env(tmp_path, world.model, world.other_model, world.chat, world.finished)
    try:
        result = run_cli(case.setup(env))
        assert result.code == case.code, result
        printed = result.out + result.err
        for needle in case.needles:
            assert needle in printed, (needle, result)
        if case.check is not None:
            case.check(env, result)
    finally:
        for cleanup in reversed(env.cleanups):
            cleanup()
