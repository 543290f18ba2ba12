"""The Python API: `from leantune import train, load_config, Config,
evaluate, export_model` works, stays light to import, and is as quiet as the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import write_jsonl

import leantune
from leantune.config import ConfigError
from leantune.models.paths import ModelPathError

SRC = Path(__file__).resolve().parents[2] / "src"
ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Order {i}?"},
            {"role": "assistant", "content": f"Order {i} ships today."},
        ]
    }
    for i in range(8)
]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter with this checkout's sources first on the path."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_import_is_light(tmp_path: Path) -> None:
    result = _python(
        """
        import json, sys, time
        start = time.perf_counter()
        import leantune
        from leantune import Config, load_config
        from leantune.cli.app import build_parser
        from leantune.models.paths import check_model_path
        build_parser()
        seconds = time.perf_counter() - start
        heavy = [m for m in ("torch", "transformers", "peft", "bitsandbytes") if m in sys.modules]
        print(json.dumps({"seconds": seconds, "heavy": heavy, "names": dir(leantune)}))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["heavy"] == [], "the API and the CLI's checks import torch only when they run"
    assert out["seconds"] < 5, out  # generous: it measured ~0.1 s
    assert {"Config", "load_config", "train", "evaluate", "export_model"} <= set(out["names"])
    assert result.stderr == ""


def test_a_tiny_train_evaluate_and_export_from_python_print_no_warnings(
    tmp_path: Path, tiny_qwen2_dir: Path
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    run = tmp_path / "run"
    result = _python(
        f"""
        import json
        from leantune import Config, evaluate, export_model, load_config, train

        cfg = load_config(None, [
            "model.path={tiny_qwen2_dir}", "data.train={data}", "data.format=chat",
            "data.eval=null", "data.max_seq_len=64", "train.eval_exact_match=false",
            "train.max_steps=2", "train.micro_batch_size=4", "run.progress=false",
            "run.dir={run}",
        ])
        assert isinstance(cfg, Config)
        summary = train(cfg, log=None)
        scores = evaluate("{run}", "{data}", max_new_tokens=2)
        report = export_model("{run}", "hf", "{tmp_path / "export"}")
        print(json.dumps({{"summary": summary, "scores": scores, "passed": report["passed"]}}))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["summary"]["steps"] == 2
    assert out["scores"]["examples"] == len(ROWS) and "exact_match" in out["scores"]
    assert out["passed"] is True
    assert (run / "final").is_dir()
    # bitsandbytes' kernel message is quieted by `models.quiet.quiet_import_noise`; the API calls
    # the same function as the CLI, so it goes with the CLI's.
    noise = [
        line for line in result.stderr.splitlines() if line.strip() and "gemm_4bit" not in line
    ]
    assert noise == [], result.stderr


def test_api_errors_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.lr"):
        leantune.train(None, ["train.lr=-1"])
    with pytest.raises(TypeError, match="load_config"):
        leantune.train(leantune.Config(), ["train.lr=1e-4"])
    with pytest.raises(ModelPathError, match="no such file or directory"):
        leantune.evaluate(tmp_path / "nope", tmp_path / "data.jsonl")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        leantune.nope  # noqa: B018
