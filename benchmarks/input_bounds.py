"""Benchmark the input bounds (issue 11, section 5): long conversations and over-long lines.

Each case runs twice in the same run, each time in a fresh child process (time and peak RSS):
"old" is leantune before issue 11, reproduced here (the chat template rendered once per prefix
to find the answers, the supervised mask built as tokens x spans, every record tokenised whole
before its length is checked); "new" is leantune's `encode_batch` (one render walked against
the template's probed shape, a merged mask, the token floor that rejects a certainly over-long
record before tokenising). Old runs are stopped at `--cap-s` seconds or `--max-rss-gb`.

    python benchmarks/input_bounds.py                    # SmolLM2 tokenizer, all cases
    python benchmarks/input_bounds.py --cases chat-2000-turns --cap-s 60

Cases: one chat record of 2,000 user/assistant turns and one of 40,000 messages (1.4 MB), both
tokenised whole (data.max_seq_len above their length), the 40,000 messages again at
data.max_seq_len=2048, and one 50 MB text line at data.max_seq_len=2048. Prints a table, then
one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "chat-2000-turns": {"turns": 2000, "max_seq_len": 10_000_000},
    "chat-40000-messages": {"turns": 20_000, "max_seq_len": 10_000_000},
    "chat-40000-messages-2048": {"turns": 20_000, "max_seq_len": 2048},
    "text-50mb-line": {"text_mb": 50, "max_seq_len": 2048},
}


def make_line(case: dict[str, Any]) -> bytes:
    """The case's one JSONL line."""
    if "text_mb" in case:
        words = "the order has not arrived yet, please help me with a refund "
        n = case["text_mb"] * (1 << 20) // len(words)
        return json.dumps({"text": words * n}).encode()
    msgs = [{"role": "system", "content": "Answer with the number."}]
    for i in range(case["turns"]):
        msgs.append({"role": "user", "content": f"{i}+1?"})
        msgs.append({"role": "assistant", "content": f"{i + 1}"})
    return json.dumps({"messages": msgs}, separators=(",", ":")).encode()


# --- leantune before issue 11 -----------------------------------------------------------------


def old_spans(tok: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    def render(ms: list[dict[str, str]], gen: bool) -> str:
        return tok.apply_chat_template(ms, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(messages[:i], True) if i else ""
        through = full if i == len(messages) - 1 else render(messages[: i + 1], False)
        spans.append((len(before), len(through)))
    return full, spans


def old_encode(tok: Any, parsed: dict[str, Any], max_seq_len: int) -> dict[str, Any]:
    import numpy as np

    if "text" in parsed:
        ids = tok(parsed["text"], add_special_tokens=True)["input_ids"]
        n = len(ids) + 1
        return {"tokens": n, "dropped": "too_long" if n > max_seq_len else None}
    full, spans = old_spans(tok, parsed["messages"])
    enc = tok([full], add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"][0], dtype=np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"][0]], dtype=np.int64)
    mask = np.zeros(ids.size, dtype=bool)
    for s, e in spans:
        mask |= (starts >= s) & (starts < e)
    dropped = "too_long" if ids.size > max_seq_len else None
    return {"tokens": int(ids.size), "supervised": int(mask[1:].sum()), "dropped": dropped}


def new_encode(tok: Any, parsed: dict[str, Any], max_seq_len: int) -> dict[str, Any]:
    from leantune.data.prepare.records import Dropped, encode_batch

    [out] = encode_batch(tok, [parsed], max_seq_len)
    if isinstance(out, Dropped):
        return {"dropped": out.kind, "reason": out.reason}
    ids, labels = out
    dropped = "too_long" if ids.size > max_seq_len else None
    return {"tokens": int(ids.size), "supervised": int((labels != -100).sum()), "dropped": dropped}


def run_one(args: argparse.Namespace) -> None:
    """Child process: one case, one method; prints its result as JSON."""
    import resource

    import psutil

    from leantune.data.formats import parse_record
    from leantune.models.loading import load_tokenizer, resolve_model

    case = CASES[args.run_one]
    tok = load_tokenizer(resolve_model(args.model))
    line = make_line(case)
    fmt = "text" if "text_mb" in case else "chat"
    baseline = psutil.Process().memory_info().rss
    start = time.perf_counter()
    parsed = parse_record(json.loads(line), fmt)
    encode = old_encode if args.method == "old" else new_encode
    result = encode(tok, parsed, case["max_seq_len"])
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "seconds": round(seconds, 3),
                "peak_rss_mb": round(peak / (1 << 20), 1),
                "rss_before_mb": round(baseline / (1 << 20), 1),
                "line_mb": round(len(line) / (1 << 20), 2),
                **result,
            }
        )
    )


def measure(case: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one case and method in a child; stop it past the time or memory cap."""
    import psutil

    cmd = [sys.executable, __file__, "--run-one", case, "--method", method, "--model", args.model]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    proc = psutil.Process(child.pid)
    peak, stopped = 0, ""
    while child.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, proc.memory_info().rss)
        elapsed = time.perf_counter() - start
        if peak > args.max_rss_gb * (1 << 30):
            stopped = f"stopped above {args.max_rss_gb:g} GB RSS after {elapsed:.0f} s"
        elif elapsed > args.cap_s:
            stopped = f"stopped at the {args.cap_s:g} s cap"
        if stopped:
            child.kill()
            child.wait()
            break
        time.sleep(0.05)
    row: dict[str, Any] = {"case": case, "method": method}
    if stopped:
        return {**row, "stopped": stopped, "peak_rss_mb": round(peak / (1 << 20), 1)}
    stdout = child.stdout.read().decode() if child.stdout else ""
    if child.returncode != 0 or not stdout.strip():
        return {**row, "stopped": f"exit code {child.returncode}"}
    return {**row, **json.loads(stdout.strip().splitlines()[-1])}


def _cell(r: dict[str, Any]) -> str:
    if "stopped" in r:
        return r["stopped"]
    what = r["dropped"] or f"{r['tokens']} tokens, {r.get('supervised', r['tokens'])} supervised"
    return f"{r['seconds']:.2f} s, {r['peak_rss_mb']:.0f} MB peak RSS; {what}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--methods", default="old,new")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--cap-s", type=float, default=300.0, help="stop a run after this long")
    p.add_argument("--max-rss-gb", type=float, default=6.0, help="stop a run above this RSS")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--method", default="new", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_one:
        run_one(args)
        return
    results = []
    for case in args.cases.split(","):
        for method in args.methods.split(","):
            results.append(measure(case, method, args))
            print(json.dumps(results[-1]), flush=True)
    print(f"\n{'case':26} {'method':6} result")
    for r in results:
        print(f"{r['case']:26} {r['method']:6} {_cell(r)}")
    payload = {
        "benchmark": "input_bounds",
        "model": args.model,
        "cap_s": args.cap_s,
        "max_rss_gb": args.max_rss_gb,
        "results": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
