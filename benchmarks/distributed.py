"""Peak memory per rank and step time of the demo model on 1 process and on 2 (ddp, fsdp2,
DeepSpeed ZeRO-3).

    PYTHONPATH=src python benchmarks/distributed.py [--steps 8] [--out FILE] [--only TEXT]

SmolLM2-135M-Instruct, LoRA, the demo's data packed to 512-token rows, train.precision as the
demo resolves it, 2 rows per step: one process with micro-batch 2 (and with micro-batch 1 x 2,
the work each rank of the 2-process runs does), and two processes under torchrun with
micro-batch 1 each, gloo. Peak memory is each process's peak resident set size when training
ends (before final/ is written: fsdp2 builds the whole model again on rank 0 for it), and what
it holds then; the step time is the median of rank 0's `step_time_s` after the first two steps.
Threads: the one process uses every core, each of the two processes half of them (they share
the machine). One JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from leantune.layout import RunPaths

SETTINGS = [
    "run.progress=false",
    "train.eval_exact_match=false",
    "data.eval=null",
    "train.save_every=0",
    "method.dropout=0",
]
RUNS: dict[str, tuple[int, list[str]]] = {
    "1 process, micro-batch 2": (1, ["train.micro_batch_size=2", "train.grad_accum=1"]),
    "1 process, micro-batch 1 x 2": (1, ["train.micro_batch_size=1", "train.grad_accum=2"]),
    "2 processes ddp, micro-batch 1": (
        2,
        ["train.micro_batch_size=1", "train.grad_accum=2", "dist.strategy=ddp"],
    ),
    "2 processes fsdp2, micro-batch 1": (
        2,
        ["train.micro_batch_size=1", "train.grad_accum=2", "dist.strategy=fsdp2"],
    ),
    "2 processes deepspeed zero3, micro-batch 1": (
        2,
        ["train.micro_batch_size=1", "train.grad_accum=2", "dist.strategy=deepspeed"],
    ),
}


def child(out_dir: Path, argv: list[str]) -> int:
    """One rank: `leantune train`, recording its peak RSS as training ends."""
    from leantune.cli import app as cli
    from leantune.core.process_memory import current_rss_bytes, peak_rss_bytes
    from leantune.training import recipe

    finish = recipe.finish

    def measured_finish(*args: Any, **kwargs: Any) -> dict[str, Any]:
        peak = peak_rss_bytes()
        # What the rank holds now (the peak also counts the whole model every rank loads
        # before ZeRO-3 partitions it).
        now = current_rss_bytes()
        rank = os.environ.get("RANK", "0")
        record = {"peak_rss_bytes": peak, "rss_at_end_bytes": now}
        (out_dir / f"rank-{rank}.json").write_text(json.dumps(record))
        return finish(*args, **kwargs)

    recipe.finish = measured_finish  # type: ignore[assignment]
    return cli.main(argv)


def run(name: str, nproc: int, extra: list[str], steps: int, work: Path) -> dict[str, Any]:
    out = work / name.replace(" ", "_").replace(",", "")
    out.mkdir()
    cores = os.cpu_count() or 1
    threads = max(1, cores // nproc)
    args = ["train", *SETTINGS, f"train.max_steps={steps}", f"run.dir={out / 'run'}", *extra]
    me = str(Path(__file__).resolve())
    if nproc == 1:
        command = [sys.executable, me, "--child", str(out), "--", *args]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            me,
            "--child",
            str(out),
            "--",
            *args,
        ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in RunPaths(out / "run").metrics.open()]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]
    peaks = [r["peak_rss_bytes"] for r in ranks]
    times = [r["step_time_s"] for r in rows[2:]]
    return {
        "run": name,
        "processes": nproc,
        "threads_per_process": threads,
        "peak_rss_gib_per_rank": [round(p / 2**30, 3) for p in peaks],
        "rss_at_end_gib_per_rank": [round(r["rss_at_end_bytes"] / 2**30, 3) for r in ranks],
        "median_step_time_s": round(statistics.median(times), 3),
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows[2:]), 1),
        "final_loss": rows[-1]["loss"],
        "losses": [round(r["loss"], 5) for r in rows],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/distributed-cpu.json")
    p.add_argument("--model", default=None, help="another model.path (a smoke run)")
    p.add_argument("--only", default=None, help="only the runs whose name contains this")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.child:
        raise SystemExit(child(Path(args.child), [a for a in rest if a != "--"]))
    results: list[dict[str, Any]] = []
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in cpuinfo if x.startswith("model name")), "?")
    report = {"benchmark": "distributed", "cpu": cpu, "cores": os.cpu_count(), "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, extra) in RUNS.items():
            if args.only and args.only not in name:
                continue
            model = [f"model.path={args.model}"] if args.model else []
            results.append(run(name, nproc, [*model, *extra], args.steps, Path(tmp)))
            r = results[-1]
            print(
                f"{name:34} peak RSS/rank {r['peak_rss_gib_per_rank']} GiB, "
                f"step {r['median_step_time_s']} s, loss {r['final_loss']:.4f}",
                flush=True,
            )
            # Written after every run: a run that fails or is stopped keeps the ones before.
            Path(args.out).write_text(json.dumps({**report, "results": results}, indent=2) + "\n")
    report["results"] = results
    print(json.dumps(report))


if __name__ == "__main__":
    main()
