"""Which model size fits which method on a 16, 24, 32 or 64 GiB CPU machine: the planner's
answer (`leantune plan`), for Qwen2.5's published shapes with their own 151,936-token
vocabulary, 512-token rows, a global batch of 8, tcmalloc (what `leantune train` preloads), and
beside it what benchmarks/scale.py measured where it ran (benchmarks/results/scale-cpu.json).

A machine of N GiB is taken to leave N - 1.5 GiB available (the OS and a shell), of which the
planner's default budget is 90% (`memory.budget.SAFETY`). Each cell is the fastest setting
the planner finds for that method within the budget (its margin included), or "no".
Only config.json files are written: no weights, nothing downloaded.

Usage:
    PYTHONPATH=src python benchmarks/fit_table.py
Prints a markdown table and ends with one JSON line.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from transformers import Qwen2Config

from leantune.bench.model_shapes import SHAPES, dimensions
from leantune.memory.budget import SAFETY
from leantune.memory.estimate import GIB
from leantune.training.checks import load_config
from leantune.training.plan_report import plan

SHAPES_ALL = {
    # The dimensions only: this table's configs set their own vocabulary and tying below.
    **{shape: dimensions(shape) for shape in SHAPES},
    "3b": {  # Qwen2.5-3B's config.json
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
    },
}
ORDER = ("0.5b", "1.5b", "3b", "7b")
METHODS = ("full", "lora", "qlora")
MACHINES_GIB = (16, 24, 32, 64)
OS_RESERVE_GIB = 1.5
ROWS = (512, 512, 8, 8)  # supervised per row, longest row, rows, examples
MEASURED = Path(__file__).parent / "results" / "scale-cpu.json"


def model_dir(root: Path, shape: str) -> Path:
    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    Qwen2Config(
        **SHAPES_ALL[shape],
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=shape != "7b",
        torch_dtype="bfloat16",
    ).save_pretrained(out)
    return out


def cell(result: dict[str, Any], method: str) -> str:
    rec = result["recommended"]
    if rec is None or rec["method"] != method:
        return "no"
    parts = [f"mb {rec['micro_batch']}"]
    if rec["gradient_checkpointing"]:
        parts.append("ckpt")
    if rec.get("model_dtype"):
        parts.append(f"{rec['model_dtype']} weights")
    if rec["optimizer"] != "adamw":
        parts.append(rec["optimizer"])
    return ", ".join(parts) + f" ({rec['breakdown']['needed'] / GIB:.1f})"


def measured() -> dict[tuple[str, str], float]:
    if not MEASURED.is_file():
        return {}
    rows = json.loads(MEASURED.read_text())["rows"]
    return {(r["shape"], r["method"]): r["train_peak_gib"] for r in rows if "train_peak_gib" in r}


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="leantune-fit-"))
    data = root / "d.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    )
    seen = measured()
    table: list[dict[str, Any]] = []
    for shape in ORDER:
        folder = model_dir(root, shape)
        for method in METHODS:
            cfg = load_config(
                None,
                [
                    f"model.path={folder}",
                    f"data.train={data}",
                    "data.max_seq_len=512",
                    f"method.name={method}",
                    "train.global_batch_size=8",
                ],
            )
            row: dict[str, Any] = {"shape": shape, "method": method}
            for gib in MACHINES_GIB:
                budget = int((gib - OS_RESERVE_GIB) * SAFETY * GIB)
                result = plan(cfg, "cpu", str(budget), ROWS, allocator="tcmalloc")
                row[f"{gib}GiB"] = cell(result, method)
            row["params"] = result["configured"]["total_params"]
            if (shape, method) in seen:
                row["measured_train_peak_gib"] = seen[(shape, method)]
            table.append(row)
            print(json.dumps(row), flush=True)
    head = "| model | method | " + " | ".join(f"{g} GiB" for g in MACHINES_GIB) + " | measured |"
    print("\n" + head + "\n|" + "---|" * (len(MACHINES_GIB) + 3))
    for r in table:
        cells = " | ".join(r[f"{g}GiB"] for g in MACHINES_GIB)
        peak = r.get("measured_train_peak_gib")
        mark = f"measured: {peak} GiB training peak (49k vocabulary)" if peak else "predicted"
        print(f"| {r['shape']} ({r['params'] / 1e9:.2f}B) | {r['method']} | {cells} | {mark} |")
    print(json.dumps({"benchmark": "fit_table", "rows": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
