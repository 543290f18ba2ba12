"""The preference demo: a short SFT run, then DPO on near-miss pairs; held-out exact match of
both models, with the wrong fields counted.

    python -m leantune.demo.preference [--out runs/demo-preference] [--sft-steps N]
        [--pairs contrast|balanced|on-policy] [--pair-messages N] [DPO overrides]

1. SFT: the built-in demo (configs/demo.yaml) cut to `--sft-steps` updates, so the model knows
   the JSON format but still gets fields wrong (low priorities read as normal, products named
   where the message has none).
2. Pairs from `--pair-messages` messages that neither its data nor the held-out set contains
   (`PAIR_SOURCES`): ``contrast`` (the default) pairs each correct ticket with it at each other
   priority (`support_pairs.priority_contrast_pairs`); ``balanced`` and ``on-policy`` reject the
   SFT model's own greedy answers (`support_pairs.balanced_on_policy_pairs`, `on_policy_pairs`).
3. DPO: configs/demo_dpo.yaml on those pairs, `model.path` the SFT run: its LoRA is merged into
   the DPO run's start model, and the reference is that model with the DPO adapter off.
4. Exact match of the SFT model and of the DPO model on the same held-out messages (greedy,
   fp32), printed as a table and one JSON line, also written to `<out>/demo_preference.json`.

A stage whose output exists is not run again (delete `<out>` to start over).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantune.api import train
from leantune.core.writes import write_file
from leantune.demo.support_desk import ANSWER_KEYS, write_jsonl
from leantune.demo.support_pairs import (
    DATA,
    balanced_on_policy_pairs,
    on_policy_pairs,
    priority_contrast_pairs,
    read_jsonl,
)
from leantune.eval.exact_match import answers_match, evaluate_exact_match
from leantune.layout import RunPaths
from leantune.methods.artifacts import load_for_inference

DPO_CONFIG = Path(__file__).parent.parent / "configs" / "demo_dpo.yaml"
HELD_OUT = DATA / "support_eval.jsonl"
# Messages in neither the SFT data nor the held-out set (`support_pairs.py`).
PAIR_MESSAGES = DATA / "support_pairs_train.jsonl"


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


def greedy_answers(
    model_path: Path, conversations: list[list[dict[str, str]]], batch_size: int
) -> tuple[float, list[str]]:
    """Exact match and greedy answers (fp32, 64 new tokens) of a model on `conversations`."""
    model, tokenizer = load_for_inference(str(model_path), "fp32")
    return evaluate_exact_match(
        model, tokenizer, conversations, batch_size=batch_size, max_new_tokens=64
    )


def held_out_score(
    model_path: Path, limit: int, batch_size: int, predictions_file: Path
) -> dict[str, Any]:
    """Greedy exact match of a model on the first `limit` held-out messages, and which fields
    its wrong answers got wrong (an answer may count in several); each answer with its
    reference goes to `predictions_file` (JSONL)."""
    conversations = [r["messages"] for r in read_jsonl(HELD_OUT)[:limit]]
    score, predictions = greedy_answers(model_path, conversations, batch_size)
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


Records = list[dict[str, Any]]


@dataclass(frozen=True)
class PairSource:
    """How the demo makes its DPO pairs from the pair messages (`--pairs`)."""

    build: Callable[[Records, list[str]], Records]
    """(records, the SFT model's greedy answers to them) -> pairs."""
    needs_answers: bool
    """Whether `build` reads the answers (they cost a generation pass over the messages)."""


PAIR_SOURCES = {
    "contrast": PairSource(lambda records, _: priority_contrast_pairs(records), False),
    "balanced": PairSource(balanced_on_policy_pairs, True),
    "on-policy": PairSource(on_policy_pairs, True),
}


def write_pairs(
    sft: Path, source: PairSource, messages: int, batch_size: int, pairs_file: Path
) -> int:
    """Pairs from the first `messages` messages of the pair stream (`support_pairs_train.jsonl`:
    in neither the SFT data nor the held-out set) into `pairs_file`, with the SFT model's greedy
    answers where `source` needs them; returns the number of pairs."""
    records = [
        {"messages": [*p["prompt"], *p["chosen"]]} for p in read_jsonl(PAIR_MESSAGES)[:messages]
    ]
    answers = [""] * len(records)
    if source.needs_answers:
        _, answers = greedy_answers(sft, [r["messages"] for r in records], batch_size)
    pairs = source.build(records, answers)
    # The file's order is the packing order: shuffled, a row mixes messages and priorities.
    random.Random(0).shuffle(pairs)
    write_jsonl(pairs, pairs_file)
    return len(pairs)


def run_demo(
    out: Path,
    sft_steps: int,
    dpo_overrides: Sequence[str],
    limit: int,
    batch_size: int,
    pair_messages: int,
    pair_source: str = "contrast",
) -> dict[str, Any]:
    """Run the stages into `out` (see the module docstring); returns the results."""
    started = time.perf_counter()
    sft, pairs = out / "sft", out / f"pairs_{pair_source}.jsonl"
    dpo = out / f"dpo-{pair_source}"
    if not RunPaths(sft).final.is_dir():
        # No exact match inside the run: both models are scored below, the same way.
        sft_overrides = [f"train.max_steps={sft_steps}", f"run.dir={sft}", "data.eval=null"]
        train(None, [*sft_overrides, "train.eval_exact_match=false", "run.progress=false"])
    if not pairs.is_file():
        source = PAIR_SOURCES[pair_source]
        written = write_pairs(sft, source, pair_messages, batch_size, pairs)
        print(f"{written} {pair_source} pairs from {pair_messages} messages: {pairs}")
    before = held_out_score(sft, limit, batch_size, out / "predictions_sft.jsonl")
    print(
        f"SFT ({sft_steps} steps): exact match {before['exact_match']:.1%}, wrong {before['wrong']}"
    )
    if not RunPaths(dpo).final.is_dir():
        train(DPO_CONFIG, [f"model.path={sft}", f"data.train={pairs}", f"run.dir={dpo}",
                           "run.progress=false", *dpo_overrides])  # fmt: skip
    after = held_out_score(dpo, limit, batch_size, out / "predictions_dpo.jsonl")
    dpo_summary = json.loads(RunPaths(dpo).summary.read_text(encoding="utf-8"))
    return {
        "sft_steps": sft_steps,
        "pair_source": pair_source,
        "pairs": len(read_jsonl(pairs)),
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
    parser.add_argument(
        "--pair-messages", type=int, default=100, help="messages the pairs are made from"
    )
    parser.add_argument(
        "--pairs", choices=sorted(PAIR_SOURCES), default="contrast", help="how pairs are made"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value for the DPO stage")
    args = parser.parse_args(argv)
    result = run_demo(
        args.out,
        args.sft_steps,
        args.overrides,
        args.limit,
        args.batch_size,
        args.pair_messages,
        args.pairs,
    )
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
