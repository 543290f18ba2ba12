"""What a model path means to every command: a hub id is read from the
local HF cache and nothing waits on the network unless the user opts in (HF_HUB_OFFLINE=0); a
mistyped local path is reported as one; a model directory without a tokenizer is one clear
error, before any weights load."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest
from support import run_cli, tiny_train_args, write_jsonl

from leantune.models import paths
from leantune.models.loading import (
    ModelNotFoundError,
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_model,
)

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Order {i}?"},
            {"role": "assistant", "content": f"Order {i} ships today."},
        ]
    }
    for i in range(4)
]
NOT_CACHED = "not a local path, and not in the HF cache"


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", ROWS)


@pytest.fixture
def network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every attempt to resolve a host name or open a connection, refused and recorded (the
    hub client swallows errors, so an exception alone would not show up)."""
    attempts: list[str] = []

    def refuse(name: str):  # type: ignore[no-untyped-def]
        def blocked(*args: object, **kwargs: object) -> None:
            attempts.append(f"{name}{args[:2]}")
            raise OSError("network blocked by the test")

        return blocked

    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    return attempts


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache of this test (huggingface_hub read the variable at import time)."""
    import huggingface_hub.constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return cache


def _cache_model(cache: Path, repo_id: str, model_dir: Path) -> None:
    """Lay `model_dir` out in `cache` as huggingface_hub stores a downloaded snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)


def _commands(model: str, data: Path, tmp: Path) -> dict[str, list[str]]:
    return {
        "eval": ["eval", "--model", model, "--data", str(data)],
        "generate": ["generate", "--model", model, "--prompt", "hi"],
        "export": ["export", model, "--format", "hf", "--out", str(tmp / "export")],
        "prepare": [
            *("prepare", "--data", str(data), "--format", "chat", "--model", model),
            *("--out", str(tmp / "prepared")),
        ],
        "train": [
            *("train", f"model.path={model}", f"data.train={data}", "data.eval=null"),
            *("train.eval_exact_match=false", f"run.dir={tmp / 'run'}", "run.progress=false"),
        ],
        "plan": [
            *("plan", f"model.path={model}", f"data.train={data}", "data.eval=null"),
            "train.eval_exact_match=false",
        ],
    }


COMMANDS = ["eval", "generate", "export", "prepare", "train", "plan"]


# --- hub ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("offline", [None, "1"], ids=["HF_HUB_OFFLINE unset", "HF_HUB_OFFLINE=1"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_hub_id_not_in_the_cache_fails_at_once_without_the_network(
    command: str,
    offline: str | None,
    hub_cache: Path,
    network: list[str],
    data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if offline is not None:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.chdir(tmp_path)  # no local folder named like the org
    started = time.perf_counter()
    result = run_cli(_commands("nobody-here/no-such-model", data, tmp_path)[command])
    elapsed = time.perf_counter() - started
    assert result.code == 2, result
    assert f"nobody-here/no-such-model: {NOT_CACHED} ({hub_cache})" in result.err, result.err
    assert (
        "HF_HUB_OFFLINE=0" in result.err and "hf download nobody-here/no-such-model" in result.err
    )
    assert network == [], "no network attempt unless the user opts in"
    # Before: 53 s of retries on a machine without internet. A generous bound, not a benchmark.
    assert elapsed < 30, elapsed
    assert not (tmp_path / "export").exists() and not (tmp_path / "prepared").exists()


@pytest.mark.parametrize(
    "name",
    ["./nope/model", "~/no-such-models/x", "a/b/c", "org/model.gguf", "org/model.safetensors"],
)
@pytest.mark.parametrize("command", ["eval", "generate", "train"])
def test_a_path_like_name_is_reported_as_a_missing_path(
    name: str, command: str, hub_cache: Path, network: list[str], data: Path, tmp_path: Path
) -> None:
    result = run_cli(_commands(name, data, tmp_path)[command])
    assert result.code == 2, result
    assert f"{name}: no such file or directory" in result.err, result.err
    assert "HF cache (" not in result.err
    assert network == []


@pytest.mark.parametrize("command", ["eval", "generate", "train"])
def test_a_mistyped_path_beside_its_folder_names_the_near_miss(
    command: str,
    hub_cache: Path,
    network: list[str],
    data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`runs/dmeo` has the shape of a hub id, but `runs/` is a local folder: a typo."""
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    result = run_cli(_commands("runs/dmeo", data, tmp_path)[command])
    assert result.code == 2, result
    assert "runs/dmeo: no such file or directory (did you mean runs/demo?)" in result.err
    assert network == []


def test_a_cached_hub_id_loads_from_the_cache_without_the_network(
    hub_cache: Path, network: list[str], tiny_qwen2_dir: Path, data: Path, tmp_path: Path
) -> None:
    _cache_model(hub_cache, "tiny-org/tiny-qwen", tiny_qwen2_dir)
    result = run_cli(["eval", "--model", "tiny-org/tiny-qwen", "--data", str(data)])
    assert result.code == 0, result
    by_dir = run_cli(["eval", "--model", str(tiny_qwen2_dir), "--data", str(data)])
    assert result.out.replace("tiny-org/tiny-qwen", "M") == by_dir.out.replace(
        str(tiny_qwen2_dir), "M"
    )
    result = run_cli(["generate", "--model", "tiny-org/tiny-qwen", "--prompt", "hi"])
    assert result.code == 0, result
    run = tmp_path / "run"
    result = run_cli(tiny_train_args(Path("tiny-org/tiny-qwen"), data, run, "train.max_steps=1"))
    assert result.code == 0, result
    result = run_cli(["generate", "--model", str(run), "--prompt", "hi"])  # base from the cache
    assert result.code == 0, result
    assert network == []


def test_downloads_are_opt_in(
    hub_cache: Path, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    seen: list[bool] = []

    def record(*args: object, **kwargs: object) -> None:
        seen.append(bool(kwargs["local_files_only"]))
        raise OSError("stop here")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", record)
    # A local safetensors folder is read by the model's own class (models/weight_files.py).
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", record)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", record)
    for value, allowed in [(None, False), ("1", False), ("", False), ("0", True), ("false", True)]:
        if value is None:
            monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        else:
            monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert paths.downloads_allowed() is allowed, value
        if allowed:  # any hub id may then be fetched
            assert (
                resolve_model("nobody-here/no-such-model").location == "nobody-here/no-such-model"
            )
        else:
            with pytest.raises(ModelNotFoundError, match=NOT_CACHED):
                resolve_model("nobody-here/no-such-model")
        seen.clear()
        for load in (load_model, load_tokenizer):
            with pytest.raises(Exception, match="stop here"):
                load(ModelSource(str(tiny_qwen2_dir)))
        assert seen == [not allowed, not allowed], value


@pytest.mark.parametrize(
    "name,hub",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("meta-llama/Llama-3.2-1B", True),
        ("org/name", True),
        ("org/name/sub", False),
        ("./org/name", False),
        ("/abs/path", False),
        ("~/models/x", False),
        ("org\\name", False),
        ("org/../name", False),
        ("org/model.gguf", False),
        ("org/weights.SAFETENSORS", False),
        ("just-a-name", False),
    ],
)
def test_looks_like_hub_id(name: str, hub: bool) -> None:
    assert paths.looks_like_hub_id(name) is hub


# --- tokenizers ---------------------------------------------------------------------------


def _without_tokenizer(model_dir: Path, out: Path) -> Path:
    shutil.copytree(model_dir, out)
    for f in out.iterdir():
        if f.name not in ("config.json", "generation_config.json", "model.safetensors"):
            f.unlink()
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("command", ["eval", "generate", "export", "prepare", "train"])
def test_a_model_without_a_tokenizer_is_one_clear_error_before_the_weights_load(
    arch: str,
    command: str,
    tiny_qwen2_dir: Path,
    tiny_llama_dir: Path,
    data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: a Qwen2 directory got an empty one-token tokenizer (then a chat-template error
    after the model had loaded); a Llama one a six-line message about sentencepiece/tiktoken."""
    from transformers import AutoModelForCausalLM

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights loaded before the tokenizer was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    model = _without_tokenizer(
        tiny_qwen2_dir if arch == "qwen2" else tiny_llama_dir, tmp_path / "m"
    )
    result = run_cli(_commands(str(model), data, tmp_path)[command])
    assert result.code == 2, result
    assert f"{model}: no tokenizer (none of tokenizer.json, tokenizer.model" in result.err
    assert "Copy the tokenizer files" in result.err
    assert "sentencepiece" not in result.err and len(result.err.strip().splitlines()) == 1


def test_a_tokenizer_that_needs_a_missing_package_says_which(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is not None:
        pytest.skip("sentencepiece is installed: the slow tokenizer would load")
    model = _without_tokenizer(tiny_llama_dir, tmp_path / "m")
    (model / "tokenizer.model").write_bytes(b"\x00" * 16)  # a sentencepiece model file
    (model / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    result = run_cli(["generate", "--model", str(model), "--prompt", "hi"])
    assert result.code == 2, result
    assert f"{model}: its tokenizer needs the sentencepiece or tiktoken package" in result.err
    assert len(result.err.strip().splitlines()) == 1


# --- a file inside a model directory -------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("file", ["model.safetensors", "config.json"])
def test_a_file_of_a_model_directory_says_to_give_the_folder(
    command: str, file: str, tiny_qwen2_dir: Path, data: Path, tmp_path: Path
) -> None:
    """`model.path=DIR/model.safetensors` names the folder to give, not itself as a near miss."""
    weights = tiny_qwen2_dir / file
    assert weights.is_file()
    result = run_cli(_commands(str(weights), data, tmp_path)[command])
    assert result.code == 2, result
    assert f"{weights}: a file of the model directory {tiny_qwen2_dir}" in result.err, result.err
    assert f"give the directory: {tiny_qwen2_dir}" in result.err, result.err
    assert "did you mean" not in result.err and "no such file" not in result.err
    assert not (tmp_path / "export").exists() and not (tmp_path / "run").exists()
