"""No traceback, ever: what escapes a command is exit 2 with a message or a labelled internal
error (exit 70) whose traceback goes to a log file; and the cases that would otherwise raise one
(a chat template that refuses a conversation in `generate` and `export`, a pickled model, a
damaged or read-only run given to `report`, `eval --lm-eval` without the network) are exit 2 with
a message that names the file and the fix.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from model_zoo import save_family_model
from safetensors import SafetensorError
from safetensors.torch import load_file
from support import run_cli, tiny_train_args, write_jsonl

from leantune.core import writes

INTERNAL = re.compile(
    r"^(?P<rank>rank \d+ of \d+: )?internal error: RuntimeError: boom; full traceback in "
    r"(?P<log>\S+); please report$"
)
ROWS = [
    {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
    for i in range(8)
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2_dir: Path) -> Path:
    """A finished 1-step run on the tiny Qwen2."""
    tmp = tmp_path_factory.mktemp("no_traceback")
    data = write_jsonl(tmp / "d.jsonl", ROWS)
    run = tmp / "run"
    done = run_cli(tiny_train_args(tiny_qwen2_dir, data, run, "train.max_steps=1"))
    assert done.code == 0, done
    return run


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 2 with its real chat template (refuses system turns, wants alternation)."""
    return save_family_model(tmp_path_factory.mktemp("gemma2"), "gemma2")


def _boom(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError("boom")


def _internal(err: str) -> re.Match[str]:
    """The one line an internal error prints, parsed; nothing else on stderr."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    found = INTERNAL.match(lines[0])
    assert found is not None, err
    return found


# --- the top-level handler --------------------------------------------------------------------


def test_an_unexpected_exception_is_exit_70_with_the_traceback_in_the_run_dir(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("leantune.monitor.report.read_run", _boom)
    done = run_cli(["report", str(run_dir)])
    assert done.code == 70
    log = Path(_internal(done.err)["log"])
    assert log.parent == run_dir and log.name.startswith("crash-")
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: boom" in text
    assert "leantune report" in text  # the command line that failed heads the log
    log.unlink()


def test_without_a_run_dir_the_log_goes_to_leantune_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("leantune.training.plan_report.plan", _boom)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    done = run_cli(["plan", f"model.path={tiny_qwen2_dir}", f"data.train={data}"])
    assert done.code == 70
    log = Path(_internal(done.err)["log"])
    assert log.parent == tmp_path / "home" / "crashes"
    assert "RuntimeError: boom" in log.read_text()


def test_an_unwritable_home_falls_back_to_the_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("LEANTUNE_HOME", str(blocked / "home"))  # under a file: cannot be made
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    monkeypatch.setattr("leantune.training.plan_report.plan", _boom)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    done = run_cli(["plan", f"model.path={tiny_qwen2_dir}", f"data.train={data}"])
    assert done.code == 70
    log = Path(_internal(done.err)["log"])
    assert log.is_relative_to(tmp_path / "tmp") and "RuntimeError: boom" in log.read_text()


def test_a_rank_of_a_distributed_train_names_itself_and_logs_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("leantune.training.recipe.train", _boom)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    run = tmp_path / "run"
    run.mkdir()
    done = run_cli(tiny_train_args(tiny_qwen2_dir, data, run))
    assert done.code == 70
    found = _internal(done.err)
    assert found["rank"] == "rank 1 of 2: "
    log = Path(found["log"])
    assert log.parent == run and "rank1" in log.name
    assert "RuntimeError: boom" in log.read_text()


def _library_write_refused(code: int, kind: str) -> Callable[..., None]:
    """A stand-in for a library's own writer (transformers' save_pretrained, safetensors'
    save_file) meeting a full or read-only disk, as each reports it."""

    def fail(*_args: object, **_kwargs: object) -> None:
        if kind == "safetensors":  # Rust's text: no errno attribute, no file name
            raise SafetensorError(
                f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})"
            )
        raise OSError(code, os.strerror(code), "/elsewhere/shard-1.safetensors")

    return fail


@pytest.mark.parametrize("kind", ["safetensors", "oserror"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_library_write_refused_by_the_disk_is_exit_2_not_an_internal_error(
    code: int, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    """A write leantune's own helpers did not make (a library's) still meets the promise: a
    full, over-quota or read-only disk is the user's to fix, exit 2, the file named where the
    error names one, else the command's output, and no crash log."""
    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(
        "leantune.bench.throughput.run_benchmark", _library_write_refused(code, kind)
    )
    out = tmp_path / "bench"
    done = run_cli(["bench", "throughput", "--model", str(tiny_qwen2_dir), "--out", str(out)])
    assert done.code == 2, done
    lines = done.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.err
    assert (
        f"[{errno.errorcode[code]}]" in lines[0] and "then run the same command again" in lines[0]
    )
    named = "/elsewhere/shard-1.safetensors" if kind == "oserror" else str(out)
    assert named in lines[0], lines[0]
    assert not (tmp_path / "home" / "crashes").exists()


def test_an_error_of_another_errno_in_a_library_write_is_still_internal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    """Only the refusals a read never meets are the user's without a named file: an I/O error
    or a permission error of a library's unnamed write stays leantune's to explain (exit 70)."""
    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(
        "leantune.bench.throughput.run_benchmark",
        _library_write_refused(errno.EIO, "safetensors"),
    )
    done = run_cli(["bench", "throughput", "--model", str(tiny_qwen2_dir), "--out", str(tmp_path)])
    assert done.code == 70, done
    assert "internal error: SafetensorError" in done.err


# --- chat templates that refuse a conversation ------------------------------------------------


def test_generate_with_a_template_that_refuses_names_it_and_the_role(
    tmp_path: Path, gemma2_dir: Path
) -> None:
    template = tmp_path / "refuses.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ raise_exception('no users here') }}{% endif %}{% endfor %}"
    )
    done = run_cli(
        ["generate", "--model", str(gemma2_dir), "--prompt", "hi", "--chat-template", str(template)]
    )
    assert done.code == 2
    assert str(template) in done.err and "message 1 (user)" in done.err
    assert "no users here" in done.err


def test_export_with_data_the_template_refuses_names_the_file_line_and_role(
    tmp_path: Path, gemma2_dir: Path
) -> None:
    turns = [("user", "a"), ("user", "b"), ("assistant", "c")]
    data = write_jsonl(
        tmp_path / "held_out.jsonl",
        [{"messages": [{"role": r, "content": c} for r, c in turns]}],
    )
    out = tmp_path / "out"
    done = run_cli(
        ["export", str(gemma2_dir), "--format", "hf", "--out", str(out), "--data", str(data)]
    )
    assert done.code == 2
    assert f"{data}:1" in done.err and "message 2 (user)" in done.err
    assert "roles must alternate" in done.err and str(gemma2_dir) in done.err


def test_a_system_turn_gemma2_refuses_suggests_folding_it(gemma2_dir: Path) -> None:
    from transformers import AutoTokenizer

    from leantune.data.chat_spans import ConversationRefused, render_conversation
    from leantune.errors import UserError

    tok = AutoTokenizer.from_pretrained(gemma2_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ConversationRefused) as caught:
        render_conversation(tok, messages, policy="keep")
    assert isinstance(caught.value, UserError)
    text = str(caught.value)
    assert "message 1 (system)" in text and "data.system_message=fold" in text
    assert str(gemma2_dir) in text
    # The policy the data path uses by default folds it: the same conversation renders.
    assert "be brief\n\nhi" in render_conversation(tok, messages)


# --- pickled weights --------------------------------------------------------------------------


class _Marker:
    """Unpickling this object (weights_only=False) would create a file: proof that it ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


@pytest.fixture(scope="module")
def pickled_models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2_dir: Path) -> list[Path]:
    """The tiny Qwen2 as pytorch_model.bin only: plain tensors, and tensors with an object."""
    tmp = tmp_path_factory.mktemp("pickled")
    state = load_file(tiny_qwen2_dir / "model.safetensors")
    made = []
    for name, extra in (("plain", {}), ("object", {"x": _Marker(str(tmp / "RAN"))})):
        d = tmp / name
        shutil.copytree(tiny_qwen2_dir, d)
        (d / "model.safetensors").unlink()
        torch.save({**state, **extra}, d / "pytorch_model.bin")
        made.append(d)
    return made


@pytest.mark.parametrize("command", ["generate", "eval", "export", "train"])
def test_a_pickled_model_is_refused_with_how_to_convert_it(
    command: str, pickled_models: list[Path], tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    for model in pickled_models:
        argv = {
            "generate": ["generate", "--model", str(model), "--prompt", "hi"],
            "eval": ["eval", "--model", str(model), "--data", str(data)],
            "export": ["export", str(model), "--format", "hf", "--out", str(tmp_path / "x")],
            "train": tiny_train_args(model, data, tmp_path / "run", "train.max_steps=1"),
        }[command]
        done = run_cli(argv)
        assert done.code == 2, done
        assert f"{model}: pytorch_model.bin" in done.err, done.err
        assert "only safetensors" in done.err and "save_pretrained" in done.err
        assert "weights_only=False" not in done.err
    assert not (pickled_models[1].parent / "RAN").exists()


# --- report on damaged, copied and read-only runs ---------------------------------------------


@pytest.mark.parametrize(
    "content",
    [b"a: [\n", b"\xff\xfe\x00binary", b"data: {train: [1], cache_dir: 5}\n"],
    ids=["bad-yaml", "binary", "wrong-types"],
)
def test_report_on_a_damaged_config_names_it(run_dir: Path, tmp_path: Path, content: bytes) -> None:
    run = shutil.copytree(run_dir, tmp_path / "run")
    (run / "config.yaml").write_bytes(content)
    done = run_cli(["report", str(run)])
    assert done.code == 2, done
    assert str(run / "config.yaml") in done.err


def test_report_leaves_out_metrics_rows_of_the_wrong_types(run_dir: Path, tmp_path: Path) -> None:
    run = shutil.copytree(run_dir, tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 1, "loss": [1]}\n{"step": true}\n{"step": "x", "loss": 1}\n')
    done = run_cli(["report", str(run)])
    assert done.code == 0, done
    assert "1 of 1" in (run / "report.html").read_text()  # the last good step, of max_steps


def test_report_into_a_read_only_run_names_the_file_and_the_way_out(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = shutil.copytree(run_dir, tmp_path / "run")

    def read_only(where: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(where))

    # Every file leantune writes goes through the write helper (leantune.core.writes), which makes
    # each one durable before it is renamed into place: refuse there, as a read-only disk does.
    monkeypatch.setattr(writes, "_fsync_file", read_only)
    done = run_cli(["report", str(run)])
    assert done.code == 2, done
    assert str(run / "report.html") in done.err and "Read-only file system" in done.err
    assert "--out" in done.err


# --- lm-eval without the network --------------------------------------------------------------


def test_lm_eval_offline_says_it_needs_the_network_or_the_datasets_cached(
    tmp_path: Path, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "hub_task.yaml").write_text(
        "task: leantune_hub_task\ndataset_path: leantune-nobody/not-cached\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: ['a', 'b']\n"
        "doc_to_target: 0\n"
    )
    done = run_cli(
        [
            *("eval", "--model", str(tiny_qwen2_dir), "--lm-eval", "leantune_hub_task"),
            *("--lm-eval-include", str(tasks), "--lm-eval-limit", "1"),
        ]
    )
    assert done.code == 2, done
    assert "leantune_hub_task" in done.err and "network" in done.err
    assert "HF_HUB_OFFLINE=0" in done.err and "cache" in done.err
