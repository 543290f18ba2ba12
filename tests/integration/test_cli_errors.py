"""Every command-line mistake of eval, generate, bench and export: exit 2 and a message naming
the flag or path, never a traceback. Exit 1 stays the export parity failure.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import run_cli, write_jsonl

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Order {i}?"},
            {"role": "assistant", "content": json.dumps({"id": i})},
        ]
    }
    for i in range(8)
]


@dataclass
class Paths:
    """What the cases point at: a model, data, and the ways a path can be wrong."""

    model: Path
    data: Path
    run_without_final: Path
    run_with_final: Path
    empty_dir: Path
    text_file: Path
    bad_gguf: Path
    bad_config_dir: Path
    export_dir: Path
    no_records: Path
    duplicated: Path
    tmp: Path


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2_dir: Path) -> Paths:
    tmp = tmp_path_factory.mktemp("cli_errors")
    data = write_jsonl(tmp / "data.jsonl", ROWS)
    run = tmp / "run"
    result = run_cli(
        [
            "train",
            f"model.path={tiny_qwen2_dir}",
            f"data.train={data}",
            "data.eval=null",
            "data.max_seq_len=64",
            "train.eval_exact_match=false",
            "train.max_steps=2",
            "train.save_every=1",
            "train.micro_batch_size=4",
            f"run.dir={run}",
            "run.progress=false",
        ]
    )
    assert result.code == 0, result
    with_final = tmp / "run_with_final"
    shutil.copytree(run, with_final)
    shutil.rmtree(run / "final")  # as if the run had been killed before it finished
    (tmp / "empty").mkdir()
    (tmp / "notes.txt").write_text("not a model\n")
    (tmp / "five.gguf").write_bytes(b"GGUF\x03")
    bad_config = tmp / "bad_config"
    bad_config.mkdir()
    for f in tiny_qwen2_dir.glob("tokenizer*"):  # a model whose only fault is its config
        shutil.copy(f, bad_config)
    (bad_config / "config.json").write_text("{oops")
    export_dir = tmp / "earlier_export"
    shutil.copytree(tiny_qwen2_dir, export_dir)
    (export_dir / "export_report.json").write_text('{"passed": true}\n')
    no_records = write_jsonl(tmp / "no_records.jsonl", ["{oops", '{"messages": []}'])
    duplicated = tmp / "duplicated.yaml"
    duplicated.write_text(
        "method:\n  name: lora\ntrain:\n  lr: 1.0e-4\n  max_steps: 3\n  lr: 1.0e-3\n"
    )
    return Paths(
        tiny_qwen2_dir,
        data,
        run,
        with_final,
        tmp / "empty",
        tmp / "notes.txt",
        tmp / "five.gguf",
        bad_config,
        export_dir,
        no_records,
        duplicated,
        tmp,
    )


@dataclass
class Case:
    """One mistake: the arguments (built from the paths), the exit code, what stderr names."""

    args: Callable[[Paths], list[str]]
    needles: Callable[[Paths], list[str]]
    code: int = 2
    loads: bool = False
    """True where telling the mistake needs an attempt to load the model (a damaged file)."""


def _eval(p: Paths, *extra: str) -> list[str]:
    return ["eval", "--model", str(p.model), "--data", str(p.data), *extra]


def _generate(p: Paths, *extra: str) -> list[str]:
    return ["generate", "--model", str(p.model), "--prompt", "hi", *extra]


def _model(args: list[str], model: Path | str) -> list[str]:
    return [args[0], "--model", str(model), *args[3:]]


CASES: dict[str, Case] = {
    # eval: flags
    "eval --data dir": Case(
        lambda p: ["eval", "--model", str(p.model), "--data", str(p.tmp)],
        lambda p: [f"--data {p.tmp}: is a directory"],
    ),
    "eval --data missing": Case(
        lambda p: ["eval", "--model", str(p.model), "--data", str(p.tmp / "nope.jsonl")],
        lambda p: [f"--data {p.tmp / 'nope.jsonl'}: no such file"],
    ),
    "eval --batch-size 0": Case(
        lambda p: _eval(p, "--batch-size", "0"), lambda p: ["--batch-size: must be >= 1, got 0"]
    ),
    "eval --limit -1": Case(
        lambda p: _eval(p, "--limit", "-1"), lambda p: ["--limit: must be >= 1, got -1"]
    ),
    "eval --limit 0": Case(
        lambda p: _eval(p, "--limit", "0"), lambda p: ["--limit: must be >= 1, got 0"]
    ),
    "eval --limit x": Case(
        lambda p: _eval(p, "--limit", "x"), lambda p: ["--limit: expected an integer, got 'x'"]
    ),
    "eval --max-new-tokens 0": Case(
        lambda p: _eval(p, "--max-new-tokens", "0"), lambda p: ["--max-new-tokens: must be >= 1"]
    ),
    "eval --max-seq-len 0": Case(
        lambda p: _eval(p, "--max-seq-len", "0"), lambda p: ["--max-seq-len: must be >= 1"]
    ),
    "eval --max-seq-len huge": Case(
        lambda p: _eval(p, "--max-seq-len", "1000000000"),
        lambda p: ["--max-seq-len: must be <= 1048576"],
    ),
    "eval --lm-eval-limit 0": Case(
        lambda p: _eval(p, "--lm-eval-limit", "0"), lambda p: ["--lm-eval-limit: must be >= 1"]
    ),
    "eval --lm-eval-include missing": Case(
        lambda p: _eval(p, "--lm-eval", "t", "--lm-eval-include", str(p.tmp / "no_tasks")),
        lambda p: [f"--lm-eval-include {p.tmp / 'no_tasks'}: no such directory"],
    ),
    "eval --lm-eval without tasks": Case(
        lambda p: _eval(p, "--lm-eval", " , "), lambda p: ["--lm-eval: no task names in ' , '"]
    ),
    "eval --lm-eval unknown task": Case(
        lambda p: _eval(p, "--lm-eval", "no_such_task", "--lm-eval-include", str(p.empty_dir)),
        lambda p: ["--lm-eval no_such_task: Spec 'no_such_task' is not a registered task"],
        loads=True,
    ),
    # eval: model paths that are not models
    "eval --model missing": Case(
        lambda p: _model(_eval(p), p.tmp / "nope"),
        lambda p: [f"--model {p.tmp / 'nope'}: no such file or directory"],
    ),
    "eval --model empty dir": Case(
        lambda p: _model(_eval(p), p.empty_dir),
        lambda p: [f"--model {p.empty_dir}: not a model directory", "config.json"],
    ),
    "eval --model text file": Case(
        lambda p: _model(_eval(p), p.text_file),
        lambda p: [f"--model {p.text_file}: a file that is not a .gguf model"],
    ),
    "eval --model 5-byte gguf": Case(
        lambda p: _model(_eval(p), p.bad_gguf),
        lambda p: [f"{p.bad_gguf}: cannot be loaded as a model"],
        loads=True,
    ),
    "eval --model bad config.json": Case(
        lambda p: _model(_eval(p), p.bad_config_dir),
        lambda p: [f"{p.bad_config_dir}: cannot be loaded as a model"],
        loads=True,
    ),
    "eval --model run without final": Case(
        lambda p: _model(_eval(p), p.run_without_final),
        lambda p: [f"{p.run_without_final}: a leantune run without a final model", "step-000002"],
    ),
    "generate --model run without final": Case(
        lambda p: _model(_generate(p), p.run_without_final),
        lambda p: [
            f"{p.run_without_final}: a leantune run without a final model",
            "newest checkpoint: step-000002",
            "leantune train",
        ],
    ),
    # generate: sampling flags
    "generate --temperature -1": Case(
        lambda p: _generate(p, "--temperature", "-1"), lambda p: ["--temperature: must be >= 0"]
    ),
    "generate --temperature nan": Case(
        lambda p: _generate(p, "--temperature", "nan"),
        lambda p: ["--temperature: must be a finite number, got 'nan'"],
    ),
    "generate --temperature inf": Case(
        lambda p: _generate(p, "--temperature", "inf"),
        lambda p: ["--temperature: must be a finite number"],
    ),
    "generate --top-p 0": Case(
        lambda p: _generate(p, "--top-p", "0"), lambda p: ["--top-p: must be in (0, 1], got 0"]
    ),
    "generate --top-p 1.5": Case(
        lambda p: _generate(p, "--top-p", "1.5"), lambda p: ["--top-p: must be in (0, 1]"]
    ),
    "generate --top-p nan": Case(
        lambda p: _generate(p, "--top-p", "nan"), lambda p: ["--top-p: must be a finite number"]
    ),
    "generate --top-k -1": Case(
        lambda p: _generate(p, "--top-k", "-1"), lambda p: ["--top-k: must be >= 0, got -1"]
    ),
    "generate --repetition-penalty 0": Case(
        lambda p: _generate(p, "--repetition-penalty", "0"),
        lambda p: ["--repetition-penalty: must be > 0"],
    ),
    "generate --repetition-penalty inf": Case(
        lambda p: _generate(p, "--repetition-penalty", "inf"),
        lambda p: ["--repetition-penalty: must be a finite number"],
    ),
    "generate --max-new-tokens 0": Case(
        lambda p: _generate(p, "--max-new-tokens", "0"),
        lambda p: ["--max-new-tokens: must be >= 1"],
    ),
    "generate --seed -1": Case(
        lambda p: _generate(p, "--seed", "-1"), lambda p: ["--seed: must be >= 0"]
    ),
    "generate --model missing": Case(
        lambda p: _model(_generate(p), p.tmp / "nope"),
        lambda p: [f"--model {p.tmp / 'nope'}: no such file or directory"],
    ),
    "generate without --prompt or --chat": Case(
        lambda p: ["generate", "--model", str(p.model)],
        lambda p: ["generate needs --prompt TEXT, or --chat"],
    ),
    "generate --prompt empty": Case(
        lambda p: ["generate", "--model", str(p.model), "--prompt", "  "],
        lambda p: ["--prompt: empty"],
    ),
    # bench
    "bench methods --steps 0": Case(
        lambda p: ["bench", "methods", "--steps", "0", "--out", str(p.tmp / "bench")],
        lambda p: ["--steps: must be >= 1, got 0"],
    ),
    "bench methods --steps -2": Case(
        lambda p: ["bench", "methods", "--steps", "-2", "--out", str(p.tmp / "bench")],
        lambda p: ["--steps: must be >= 1, got -2"],
    ),
    "bench methods --lr lora=nan": Case(
        lambda p: ["bench", "methods", "--lr", "lora=nan", "--out", str(p.tmp / "bench")],
        lambda p: ["--lr 'lora=nan': the rate must be a finite number in (0, 1)"],
    ),
    "bench methods --lr unknown method": Case(
        lambda p: ["bench", "methods", "--lr", "lroa=2e-3", "--out", str(p.tmp / "bench")],
        lambda p: ["--lr 'lroa=2e-3': unknown method 'lroa'; choose from full, lora"],
    ),
    "bench methods --out is a file": Case(
        lambda p: ["bench", "methods", "--methods", "lora", "--out", str(p.text_file)],
        lambda p: [f"--out {p.text_file}: is a file; give a directory"],
    ),
    # config mistakes through the commands that read a config
    "validate train.max_grad_norm=.nan": Case(
        lambda p: ["validate", "train.max_grad_norm=.nan"],
        lambda p: ["error: override train.max_grad_norm: must be a finite number, got nan"],
    ),
    "validate a duplicated key": Case(
        lambda p: ["validate", str(p.duplicated)],
        lambda p: [f"error: {p.duplicated}:6: train.lr: duplicated key (first on line 4)"],
    ),
    "train train.weight_decay=.inf": Case(
        lambda p: [
            *("train", f"model.path={p.model}", f"data.train={p.data}", "data.eval=null"),
            *("train.eval_exact_match=false", "train.weight_decay=.inf"),
            f"run.dir={p.tmp / 'x'}",
        ],
        lambda p: ["error: override train.weight_decay: must be a finite number, got inf"],
    ),
    "train model.path=an empty dir": Case(
        lambda p: [
            *("train", f"model.path={p.empty_dir}", f"data.train={p.data}", "data.eval=null"),
            *("train.eval_exact_match=false", f"run.dir={p.tmp / 'run_x'}"),
        ],
        lambda p: [f"error: {p.empty_dir}: not a model directory (no config.json"],
    ),
    "prepare --model an empty dir": Case(
        lambda p: [
            *("prepare", "--data", str(p.data), "--format", "chat"),
            *("--model", str(p.empty_dir), "--out", str(p.tmp / "prepared_x")),
        ],
        lambda p: [f"error: {p.empty_dir}: not a model directory (no config.json"],
    ),
    "export --out under a file": Case(
        lambda p: ["export", str(p.model), "--format", "hf", "--out", str(p.text_file / "sub")],
        lambda p: [f"--out {p.text_file / 'sub'}: cannot be created (Not a directory)"],
    ),
    "plan --budget nan": Case(
        lambda p: ["plan", "--budget", "nan"],
        lambda p: ["error: --budget: 'nan' is not a memory size"],
    ),
    # export
    "export run without final": Case(
        lambda p: ["export", str(p.run_without_final), "--format", "hf", "--out", str(p.tmp / "x")],
        lambda p: [
            f"{p.run_without_final}: a leantune run without a final model",
            "newest checkpoint: step-000002",
            "leantune train",
        ],
    ),
    "export --out is a file": Case(
        lambda p: ["export", str(p.model), "--format", "hf", "--out", str(p.text_file)],
        lambda p: [f"--out {p.text_file}: is a file"],
    ),
    "export --out is the source": Case(
        lambda p: ["export", str(p.export_dir), "--format", "hf", "--out", str(p.export_dir)],
        lambda p: [f"--out {p.export_dir}: is the model being exported"],
    ),
    "export --out inside the source": Case(
        lambda p: [
            *("export", str(p.export_dir), "--format", "hf"),
            *("--out", str(p.export_dir / "again")),
        ],
        lambda p: [f"--out {p.export_dir / 'again'}: is inside the model being exported"],
    ),
    "export --samples 0": Case(
        lambda p: [
            *("export", str(p.model), "--format", "hf", "--out", str(p.tmp / "x")),
            *("--samples", "0"),
        ],
        lambda p: ["--samples: must be >= 1, got 0"],
    ),
    "export --data dir": Case(
        lambda p: [
            *("export", str(p.model), "--format", "hf", "--out", str(p.tmp / "x")),
            *("--data", str(p.empty_dir)),
        ],
        lambda p: [f"--data {p.empty_dir}: is a directory"],
    ),
    "export --data missing": Case(
        lambda p: [
            *("export", str(p.model), "--format", "hf", "--out", str(p.tmp / "x")),
            *("--data", str(p.tmp / "nope.jsonl")),
        ],
        lambda p: [f"--data {p.tmp / 'nope.jsonl'}: no such file"],
    ),
    "export --data without a valid record": Case(
        lambda p: [
            *("export", str(p.model), "--format", "hf", "--out", str(p.tmp / "x")),
            *("--data", str(p.no_records)),
        ],
        lambda p: [f"--data {p.no_records}: no valid"],
    ),
    "export missing source": Case(
        lambda p: ["export", str(p.tmp / "nope"), "--format", "hf", "--out", str(p.tmp / "x")],
        lambda p: [f"{p.tmp / 'nope'}: no such file or directory"],
    ),
    "export empty dir": Case(
        lambda p: ["export", str(p.empty_dir), "--format", "hf", "--out", str(p.tmp / "x")],
        lambda p: [f"{p.empty_dir}: not a model directory"],
    ),
    "export full model as adapter": Case(
        lambda p: ["export", str(p.model), "--format", "adapter", "--out", str(p.tmp / "x")],
        lambda p: ["--format adapter: the source is a full model"],
    ),
}


@pytest.fixture(autouse=True)
def no_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused `bench methods` must refuse before training; fail fast if it would train."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark started training")

    monkeypatch.setattr("leantune.bench.methods.run_methods", refuse)


@pytest.mark.parametrize("name", list(CASES))
def test_cli_mistake_exits_2_naming_the_flag_or_path(name: str, paths: Paths) -> None:
    case = CASES[name]
    result = run_cli(case.args(paths))  # fails on any traceback
    assert result.code == case.code, result
    for needle in case.needles(paths):
        assert needle in result.err, (needle, result.err)
    assert not (paths.tmp / "x").exists(), "a refused export must not leave its --out behind"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.loads])
def test_cli_mistake_is_refused_before_any_model_or_tokenizer_loads(
    name: str, paths: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every flag and path check runs first: with loading made impossible, the same message."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"loaded {args[:1]} before checking the arguments")

    for cls in (AutoModelForCausalLM, AutoTokenizer, AutoConfig):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    case = CASES[name]
    result = run_cli(case.args(paths))
    assert result.code == case.code, result
    for needle in case.needles(paths):
        assert needle in result.err, (needle, result.err)


def test_eval_and_generate_take_a_run_directory(paths: Paths) -> None:
    """A run directory stands for its final/ model, as it does for export."""
    run = paths.run_with_final
    result = run_cli(
        ["eval", "--model", str(run), "--data", str(paths.data), "--max-new-tokens", "2"]
    )
    assert result.code == 0, result
    assert json.loads(result.out)["examples"] == len(ROWS)
    by_run = run_cli(["generate", "--model", str(run), "--prompt", "hi", "--max-new-tokens", "4"])
    by_final = run_cli(
        ["generate", "--model", str(run / "final"), "--prompt", "hi", "--max-new-tokens", "4"]
    )
    assert by_run.code == 0 and by_final.code == 0, (by_run, by_final)
    assert by_run.out == by_final.out


def test_eval_limit_keeps_the_first_n_examples(paths: Paths) -> None:
    result = run_cli(_eval(paths, "--limit", str(len(ROWS) - 1), "--max-new-tokens", "2"))
    assert result.code == 0, result
    assert json.loads(result.out)["examples"] == len(ROWS) - 1
    result = run_cli(_eval(paths, "--limit", str(10 * len(ROWS)), "--max-new-tokens", "2"))
    assert result.code == 0, result
    assert json.loads(result.out)["examples"] == len(ROWS)


def test_uncached_hub_id_offline_is_a_clear_error(
    paths: Paths, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read by leantune's loader
    # huggingface_hub read the variable when it was imported; without this it retries the
    # network for ~20 s before giving up.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    result = run_cli(_model(_eval(paths), "nobody-here/no-such-model"))
    assert result.code == 2, result
    assert "nobody-here/no-such-model: not a local path, and not in the HF cache" in result.err


def test_export_parity_failure_still_exits_1(paths: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import leantune.export.run as run

    real = run.sample_logits
    calls = {"n": 0}

    def shifted(fn, samples):  # type: ignore[no-untyped-def]
        calls["n"] += 1  # the second call reads the export back: move its logits
        out = real(fn, samples)
        return out if calls["n"] == 1 else [t + torch.ones_like(t) for t in out]

    monkeypatch.setattr(run, "sample_logits", shifted)
    out = paths.tmp / "parity"
    result = run_cli(["export", str(paths.model), "--format", "hf", "--out", str(out)])
    assert result.code == 1, result
    assert json.loads((out / "export_report.json").read_text())["passed"] is False
