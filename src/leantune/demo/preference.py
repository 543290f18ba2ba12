"""The preference demo: a short SFT run, then DPO on near-miss pairs; held-out exact match of
both models, with the wrong fields counted.

    python -m leantune.demo.preference [--out runs/demo-preference] [--sft-steps N] [DPO overrides]

1. SFT: the built-in demo (configs/demo.yaml) cut to `--sft-steps` updates, so the model knows
   the JSON format but still gets priorities and intents wrong.
2. Merge: that run as a plain model (`leantune export --format hf`), DPO's starting point. The
   reference is then the same model with the DPO adapter off.
3. DPO: configs/demo_dpo.yaml (pairs from `demo.support_pairs`) from the merged model.
4. Exact match of the SFT model and of the DPO model on the same held-out messages (greedy,
   fp32), printed as a table and one JSON line, also written to `<out>/demo_preference.json`.

A stage whose output exists is not run again (delete `<out>` to start over).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leantune.api import export_model, train
from leantune.core.writes import write_file
from leantune.demo.support_desk import ANSWER_KEYS
from leantune.demo.support_pairs import DATA, read_jsonl
from leantune.eval.exact_match import answers_match, evaluate_exact_match
from leantune.layout import RunPaths
from leantune.methods.artifacts import load_for_inference

DPO_CONFIG = Path(__file__).parent.parent / "configs" / "demo_dpo.yaml"
HELD_OUT = DATA / "support_eval.jsonl"


def wrong_fields(prediction: str, reference: str) -> list[str]:
    """The answer keys whose values differ; ``["format"]`` when `prediction` is not a ticket."""
    try:
        predicted = json.loads(prediction.strip())
    except ValueError:
        return ["format"]
    expected = json.loads(reference)
    if not isinstance(predicted, dict) or predicted.keys() != expected.keys():
        return ["format"]
    return [k for k in ANSWER_KEYS if predicted[k] != expected[k]]


def held_out_score(
    model_path: Path, limit: int, batch_size: int, predictions_file: Path
) -> dict[str, Any]:
    """Greedy exact match of a model on the first `limit` held-out messages, and which fields
    its wrong answers got wrong (an answer may count in several); each answer with its
    reference goes to `predictions_file` (JSONL)."""
    model, tokenizer = load_for_inference(str(model_path), "fp32")
    conversations = [r["messages"] for r in read_jsonl(HELD_OUT)[:limit]]
    score, predictions = evaluate_exact_match(
        model, tokenizer, conversations, batch_size=batch_size, max_new_tokens=64
    )
    errors: Counter[str] = Counter()
    lines = []
    for prediction, conversation in zip(predictions, conversations, strict=True):
        reference = conversation[-1]["content"]
        wrong = [] if answers_match(prediction, reference) else wrong_fields(prediction, reference)
        errors.update(wrong)
        row = {"prediction": prediction, "reference": reference, "wrong": wrong}
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    write_file(predictions_file, "".join(lines))
    return {"exact_match": score, "examples": len(conversations), "wrong": dict(errors)}


def run_demo(
    out: Path, sft_steps: int, dpo_overrides: Sequence[str], limit: int, batch_size: int
) -> dict[str, Any]:
    """Run the stages into `out` (see the module docstring); returns the results."""
    started = time.perf_counter()
    sft, merged, dpo = out / "sft", out / "sft-merged", out / "dpo"
    if not RunPaths(sft).final.is_dir():
        # No exact match inside the run: both models are scored below, the same way.
        sft_overrides = [f"train.max_steps={sft_steps}", f"run.dir={sft}", "data.eval=null"]
        train(None, [*sft_overrides, "train.eval_exact_match=false", "run.progress=false"])
    if not (merged / "config.json").is_file():
        export_model(sft, "hf", merged)
    before = held_out_score(merged, limit, batch_size, out / "predictions_sft.jsonl")
    print(
        f"SFT ({sft_steps} steps): exact match {before['exact_match']:.1%}, wrong {before['wrong']}"
    )
    if not RunPaths(dpo).final.is_dir():
        train(DPO_CONFIG, [f"model.path={merged}", f"run.dir={dpo}", "run.progress=false",
                           *dpo_overrides])  # fmt: skip
    after = held_out_score(dpo, limit, batch_size, out / "predictions_dpo.jsonl")
    dpo_summary = json.loads(RunPaths(dpo).summary.read_text(encoding="utf-8"))
    return {
        "sft_steps": sft_steps,
        "dpo_steps": dpo_summary.get("steps"),
        "before_dpo": before,
        "after_dpo": after,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Run the demo and print its table and one JSON line.

    Args:
        argv: Command-line arguments; ``sys.argv[1:]`` when None.
    """
    parser = argparse.ArgumentParser(description="SFT briefly, then DPO on near-miss pairs.")
    parser.add_argument("--out", type=Path, default=Path("runs/demo-preference"))
    parser.add_argument("--sft-steps", type=int, default=40, help="updates of the SFT stage")
    parser.add_argument("--limit", type=int, default=50, help="held-out messages scored")
    parser.add_argument("--batch-size", type=int, default=50, help="prompts per generate call")
    parser.add_argument("overrides", nargs="*", help="section.key=value for the DPO stage")
    args = parser.parse_args(argv)
    result = run_demo(args.out, args.sft_steps, args.overrides, args.limit, args.batch_size)
    before, after = result["before_dpo"], result["after_dpo"]
    print(f"\nexact match on {after['examples']} held-out messages")
    for stage, scores in (("SFT", before), ("DPO", after)):
        steps = result[f"{stage.lower()}_steps"]
        print(
            f"  after {stage} ({steps} steps): {scores['exact_match']:6.1%} wrong {scores['wrong']}"
        )
    write_file(args.out / "demo_preference.json", json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
