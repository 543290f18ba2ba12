"""Training your own file starts from plain defaults.

The rule: no CONFIG and no `data.train=...` override is the built-in demo; anything else starts
from the library defaults (the dataclasses in config.py). A run without run.name and run.dir
goes to runs/<data file stem>-<method>-<hash of its fingerprint>: other data or settings get
another directory, the same command the same one (so it resumes).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from support import run_cli, write_jsonl

from leantune.config import Config, config_base, to_dict
from leantune.training.checks import check_config, load_config
from leantune.training.run_setup import default_run_name


def chat_rows(n: int, offset: int = 0) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Where is order {i}?"},
                {"role": "assistant", "content": f"Order {i} ships today."},
            ]
        }
        for i in range(offset, offset + n)
    ]


def without(d: dict, *keys: str) -> dict:
    out = json.loads(json.dumps(d))
    for key in keys:
        section, name = key.split(".")
        out[section].pop(name)
    return out


def test_no_config_and_no_data_train_is_the_demo() -> None:
    for overrides in ([], ["method.name=full"], ["train.max_steps=5"]):
        assert config_base(None, overrides) == "demo"
        cfg = load_config(None, overrides)
        assert cfg.data.train is not None and cfg.data.train.endswith("support_train.jsonl")
        assert cfg.data.eval is not None and cfg.train.eval_exact_match
        assert cfg.run.name == "demo"
    assert load_config(None, []).train.max_steps == 120
    assert load_config(None, []).train.lr == 2e-3


def test_data_train_starts_from_the_library_defaults(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "mine.jsonl", chat_rows(4))
    assert config_base(None, [f"data.train={data}"]) == "defaults"
    cfg = load_config(None, [f"data.train={data}"])
    assert without(to_dict(cfg), "data.train") == without(to_dict(Config()), "data.train")
    # What the demo would have brought: none of it.
    assert cfg.data.eval is None and not cfg.train.eval_exact_match
    assert cfg.train.lr is None and cfg.train.max_steps is None and cfg.train.epochs is None
    assert cfg.run.name == "auto"
    # data.eval=null, which failed when the demo's exact match came along, is just the default.
    assert load_config(None, [f"data.train={data}", "data.eval=null"]).data.eval is None


def test_a_config_file_starts_from_the_library_defaults(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "mine.jsonl", chat_rows(4))
    path = tmp_path / "mine.yaml"
    path.write_text(f"data:\n  train: {data}\n")
    assert config_base(path, []) == "defaults"
    cfg = load_config(path)
    assert without(to_dict(cfg), "data.train") == without(to_dict(Config()), "data.train")


def test_the_library_defaults_suit_a_users_own_data(tmp_path: Path) -> None:
    cfg = Config()
    cfg.data.train = str(write_jsonl(tmp_path / "mine.jsonl", chat_rows(4)))
    assert check_config(cfg) == []  # valid, and nothing to warn about
    d, t = cfg.data, cfg.train
    assert d.eval is None and not t.eval_exact_match and t.eval_every == 0
    assert (d.max_seq_len, d.pack, t.micro_batch_size) == ("auto", "auto", "auto")
    assert t.max_steps is None and t.epochs is None  # one epoch of the data
    assert cfg.run.name == "auto" and cfg.run.dir is None


def tiny(model: Path) -> list[str]:
    return [f"model.path={model}", "run.progress=false", "train.max_steps=2", "train.lr=1e-2"]


def test_train_says_which_base_it_uses(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "mine.jsonl", chat_rows(8))
    own = run_cli(["train", "data.train=mine.jsonl", *tiny(tiny_llama_dir)])
    assert own.code == 0, own.err
    (line,) = [x for x in own.out.splitlines() if x.startswith("config:")]
    assert "library defaults" in line and "demo" not in line
    path = tmp_path / "mine.yaml"
    path.write_text(f"data:\n  train: {data}\n")
    from_file = run_cli(["train", str(path), *tiny(tiny_llama_dir)])
    assert from_file.code == 0, from_file.err
    (line,) = [x for x in from_file.out.splitlines() if x.startswith("config:")]
    assert str(path) in line and "library defaults" in line
    # The demo (here with a model path that fails at once, so it does not train).
    demo = run_cli(["train", f"model.path={tmp_path / 'no-such-model'}"])
    assert demo.code == 2, demo
    (line,) = [x for x in demo.out.splitlines() if x.startswith("config:")]
    assert "built-in demo" in line and "data.train" in line
    assert not (tmp_path / "runs").joinpath("demo").exists()


def run_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "runs").iterdir())


def test_the_default_run_dir_is_one_per_run_and_the_same_command_resumes(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "orders.jsonl", chat_rows(8))
    write_jsonl(tmp_path / "returns.jsonl", chat_rows(8, offset=50))
    first = run_cli(["train", "data.train=orders.jsonl", *tiny(tiny_llama_dir)])
    assert first.code == 0, first.err
    (where,) = run_dirs(tmp_path)
    assert where.startswith("orders-lora-")
    assert f"run directory: {Path('runs') / where}" in first.out
    other = run_cli(["train", "data.train=returns.jsonl", *tiny(tiny_llama_dir)])
    assert other.code == 0, other.err
    assert len(run_dirs(tmp_path)) == 2
    assert next(d for d in run_dirs(tmp_path) if d != where).startswith("returns-lora-")
    # Another setting on the same data is another run, too.
    full = run_cli(["train", "data.train=orders.jsonl", "method.name=full", *tiny(tiny_llama_dir)])
    assert full.code == 0, full.err
    assert len(run_dirs(tmp_path)) == 3
    # The same command again: the same directory, resumed (nothing left to train).
    again = run_cli(["train", "data.train=orders.jsonl", *tiny(tiny_llama_dir)])
    assert again.code == 0, again.err
    assert len(run_dirs(tmp_path)) == 3
    assert f"run directory: {Path('runs') / where}" in again.out and "resumed from" in again.out


def test_a_named_run_with_other_data_still_exits_2(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "orders.jsonl", chat_rows(8))
    write_jsonl(tmp_path / "returns.jsonl", chat_rows(8, offset=50))
    args = [*tiny(tiny_llama_dir), "run.name=mine"]
    assert run_cli(["train", "data.train=orders.jsonl", *args]).code == 0
    second = run_cli(["train", "data.train=returns.jsonl", *args])
    assert second.code == 2, second
    assert "data.train: orders.jsonl" in second.err and "run.name" in second.err
    assert run_dirs(tmp_path) == ["mine"]


def test_the_default_run_name_is_a_valid_name(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from leantune.config.validate import RUN_NAME_MAX, _validate_run

    names = []
    for stem in ("my data (1)", "x" * 200, "...", "ünïcode", "plain"):
        data = write_jsonl(tmp_path / f"{stem}.jsonl", chat_rows(2))
        cfg = load_config(None, [f"data.train={data}", f"model.path={tiny_llama_dir}"])
        name = default_run_name(cfg, str(tiny_llama_dir), None)
        assert len(name) <= RUN_NAME_MAX
        _validate_run(dataclasses.replace(cfg.run, name=name))  # no ConfigError
        assert name == default_run_name(cfg, str(tiny_llama_dir), None)  # stable
        names.append(name)
    assert names[-1].startswith("plain-lora-") and len(set(names)) == len(names)
