"""Benchmark `leantune prepare`: local engine, Dask engine and a naive pandas baseline.

Generates a noisy chat corpus (HTML tags and entities, zero-width and control characters,
full-width forms, extra whitespace, CJK/Cyrillic/emoji, duplicates, near duplicates and bad
lines), then runs each engine in its own process and reports rows/s and peak RSS (the whole
process tree, sampled every 50 ms, so Dask workers count). Prints a table, then one JSON line.

    python benchmarks/prepare.py                       # 1 GB, smollm2-135m-instruct tokenizer
    python benchmarks/prepare.py --size-mb 20 --engines local,dask,naive

The naive baseline is what the source articles describe: pandas holds the whole corpus, each
cleaning rule is its own pass over every row, then each record is tokenised on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NOISE_HTML = [
    "<p>",
    "</p>",
    "<b>",
    "</b>",
    "<br/>",
    '<a href="https://x.example/?a=1&b=2">',
    "</a>",
]
SCRIPTS = [
    "中文的回答在这里",
    "Ответ на русском языке",
    "日本語の説明",
    "🎉👍 done",
    "한국어 텍스트",
]
WORDS = (  # noqa: SIM905
    "order refund delivery parcel account password invoice warranty address carrier status "
    "customer payment return exchange discount shipping tracking product support ticket"
).split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
    return " ".join(words).capitalize() + rng.choice([".", "!", "?", " & more.", " (a < b)."])


def _noisy(rng: random.Random, text: str) -> str:
    r = rng.random()
    if r < 0.3:
        text = f"{rng.choice(NOISE_HTML)}{text}{rng.choice(NOISE_HTML)} &amp; &nbsp;&copy;"
    if rng.random() < 0.2:
        text = text.replace(" ", " \u200b", 2) + "\x07"
    if rng.random() < 0.2:
        text = text.replace("a", "ａ", 3)  # full-width
    if rng.random() < 0.3:
        text = "  " + text.replace(" ", "   ", 3) + "  \n\n\n"
    if rng.random() < 0.1:
        text += " " + rng.choice(SCRIPTS)
    return text


def generate_corpus(path: Path, size_mb: float, seed: int = 0) -> int:
    """Write a noisy chat JSONL of about `size_mb` MB; returns the number of lines."""
    rng = random.Random(seed)
    target = int(size_mb * (1 << 20))
    written = lines = 0
    recent: list[str] = []
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            r = rng.random()
            if r < 0.02 and recent:
                line = rng.choice(recent)  # exact duplicate
            elif r < 0.03 and recent:
                line = rng.choice(recent).replace("order", "orders", 1)  # near duplicate
            elif r < 0.035:
                line = rng.choice(['{"messages": [', "[1, 2]", '{"text": "x"}', ""])
            else:
                q = _noisy(rng, " ".join(_sentence(rng) for _ in range(rng.randint(1, 3))))
                a = _noisy(rng, " ".join(_sentence(rng) for _ in range(rng.randint(3, 12))))
                msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                line = json.dumps({"messages": msgs}, ensure_ascii=False)
                recent = [*recent[-999:], line]
            f.write(line + "\n")
            written += len(line.encode()) + 1
            lines += 1
    return lines


def run_naive(corpus: Path, tokenizer: Any, max_seq_len: int) -> dict[str, Any]:
    """pandas, one pass per cleaning rule, then per-record tokenisation and packing."""
    import pandas as pd

    from leantune.data.formats import BadRecordError, Record, parse_record
    from leantune.data.packing import pack_examples
    from leantune.data.prepare.clean import RULES, clean_text
    from leantune.data.tokenize import encode_record

    objs = []
    with corpus.open("rb") as f:
        for raw in f:
            try:
                objs.append(parse_record(json.loads(raw), "chat"))
            except (ValueError, BadRecordError):
                continue
    df = pd.DataFrame({"messages": [o["messages"] for o in objs]})
    for rule in RULES:  # one full pass over the data per rule
        df["messages"] = df["messages"].apply(
            lambda ms, rule=rule: [{**m, "content": clean_text(m["content"], (rule,))} for m in ms]
        )
    df["key"] = df["messages"].apply(lambda ms: json.dumps(ms, sort_keys=True))
    df = df.drop_duplicates("key")
    examples = []
    for ms in df["messages"]:
        ex = encode_record(tokenizer, Record("corpus", 0, messages=tuple(ms)))
        if len(ex.input_ids) <= max_seq_len and ex.num_supervised:
            examples.append(ex)
    rows = pack_examples(examples, max_seq_len)
    return {"rows_out": len(examples), "packed_rows": len(rows)}


def run_one(args: argparse.Namespace) -> None:
    """Child process: run one engine and print its result as JSON."""
    import resource

    from leantune.data.prepare.pipeline import prepare_dataset
    from leantune.data.prepare.records import PrepareSettings
    from leantune.models.loading import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    with args.corpus.open("rb") as f:
        rows_in = sum(1 for _ in f)
    start = time.perf_counter()
    if args.run_one == "naive":
        result = run_naive(args.corpus, tokenizer, args.max_seq_len)
    else:
        settings = PrepareSettings(
            format="chat",
            max_seq_len=args.max_seq_len,
            clean=("html", "control", "nfkc", "whitespace"),
            dedup=args.dedup,
        )
        report = prepare_dataset(
            [str(args.corpus)],
            settings,
            tokenizer,
            args.out,
            engine=args.run_one,
            workers=args.workers,
            partition_mb=args.partition_mb,
            force=True,
            shard_tokens=args.shard_tokens,
        )
        result = {k: report[k] for k in ("rows_out", "packed_rows", "packing_efficiency")}
        result["out_mb"] = sum(f.stat().st_size for f in args.out.iterdir()) / (1 << 20)
        result["resume_data_mb"] = report["engine"]["resume_data_bytes"] / (1 << 20)
    seconds = time.perf_counter() - start
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {"rows_in": rows_in, "seconds": seconds, "self_peak_rss_mb": self_kb / 1024, **result}
        )
    )


def measure(engine: str, args: argparse.Namespace, corpus: Path, out: Path) -> dict[str, Any]:
    """Run one engine in a child process; sample the RSS of its whole process tree."""
    cmd = [
        sys.executable,
        __file__,
        "--run-one",
        engine,
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--model",
        args.model,
        "--max-seq-len",
        str(args.max_seq_len),
        "--workers",
        str(args.workers),
        "--dedup",
        args.dedup,
        "--shard-tokens",
        str(args.shard_tokens),
    ]
    if args.partition_mb is not None:
        cmd += ["--partition-mb", str(args.partition_mb)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    log = out.with_name(f"{out.name}.stderr")  # a file, so a chatty child never blocks on a pipe
    with log.open("w") as err:
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        peak = _watch(child, int(args.max_rss_gb * (1 << 30)))
        stdout, _ = child.communicate()
    stderr = log.read_text(errors="replace")
    row: dict[str, Any] = {"engine": engine, "peak_rss_mb": round(peak / (1 << 20), 1)}
    if child.returncode != 0:  # recorded, not raised: the other engines' results still count
        over = peak > args.max_rss_gb * (1 << 30)
        reason = (
            f"stopped above --max-rss-gb {args.max_rss_gb:g}"
            if over
            else f"exit code {child.returncode}: {stderr[-2000:]}"
        )
        seconds = round(time.perf_counter() - start, 1)
        return {**row, "failed": reason, "seconds_until_stopped": seconds}
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    result["rows_per_s"] = round(result["rows_in"] / result["seconds"], 1)
    return {**row, **result}


def _watch(child: subprocess.Popen[str], cap: int) -> int:
    """Peak RSS of the child's process tree; kills the tree once it passes `cap` bytes (so a
    baseline that holds the whole corpus in memory cannot take the machine down)."""
    import psutil

    proc = psutil.Process(child.pid)
    peak = 0
    while child.poll() is None:
        try:
            procs = [proc, *proc.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            if peak > cap:
                for p in procs:
                    p.kill()
        except psutil.Error:
            pass
        time.sleep(0.05)
    return peak


def _default_cap_gb() -> float:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return round(0.8 * total / (1 << 30), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=1024.0)
    p.add_argument("--engines", default="local,dask,naive")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--partition-mb", type=float, default=None)
    p.add_argument("--dedup", default="exact", choices=["none", "exact", "near"])
    p.add_argument("--shard-tokens", type=int, default=2_000_000)
    p.add_argument(
        "--max-rss-gb",
        type=float,
        default=_default_cap_gb(),
        help="stop an engine whose process tree passes this (default: 80%% of physical memory)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--corpus", type=Path, default=None, help="use this corpus, do not generate")
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_one:
        run_one(args)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lt_prepare_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = args.corpus
    if corpus is None:
        corpus = work / "corpus.jsonl"
        t0 = time.perf_counter()
        n = generate_corpus(corpus, args.size_mb)
        took = time.perf_counter() - t0
        print(f"generated {corpus} ({args.size_mb:g} MB, {n} lines) in {took:.0f} s")
    results = []
    for engine in args.engines.split(","):
        results.append(measure(engine, args, corpus, work / f"out-{engine}"))
        print(json.dumps(results[-1]), flush=True)  # each engine's row as soon as it is known
    head = ("rows in", "rows out", "seconds", "rows/s", "peak RSS MB")
    print(f"\n{'engine':8} {head[0]:>9} {head[1]:>9} {head[2]:>8} {head[3]:>9} {head[4]:>12}")
    for r in results:
        if "failed" in r:
            print(
                f"{r['engine']:8} failed after {r['seconds_until_stopped']:.0f} s "
                f"(peak RSS {r['peak_rss_mb']:.0f} MB): {r['failed'][:200]}"
            )
            continue
        print(
            f"{r['engine']:8} {r['rows_in']:>9} {r['rows_out']:>9} {r['seconds']:>8.1f} "
            f"{r['rows_per_s']:>9.0f} {r['peak_rss_mb']:>12.0f}"
        )
    size = corpus.stat().st_size / (1 << 20)
    print(json.dumps({"benchmark": "prepare", "corpus_mb": round(size, 1), "results": results}))


if __name__ == "__main__":  # Dask worker processes re-import the main module
    main()
