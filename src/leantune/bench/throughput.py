"""`leantune bench throughput`: leantune against HF Trainer + PEFT on the same work.

Both train the same model on the same variable-length chat corpus (`bench.chat_corpus`), one
epoch, the same hyper-parameters (LoRA r16/alpha32 on all linear layers, or full fine-tuning;
lr 2e-4 cosine), each in its own process, alternating, `reps` times. Both run in the precision
this machine runs fastest (leantune's measured `train.precision=auto`, applied to the baseline
too), or both in the one that `--precision` names. The baseline is configured as a user would
(its padding collator, `use_cpu=True`, batch 8; where that runs out of memory,
`--hf-micro-batch` accumulates the same batch of 8 from smaller micro-batches); leantune runs
with its defaults and, by default (`--updates both`), once more with the baseline's updates (8
examples per update, one per row: as many updates), so that each comparison has its own table
against the same baseline runs. `--model-shape 0.5b|1.5b` trains random weights of Qwen2.5's
published shapes, built from config (`bench.model_shapes`), instead of `--model`.

Reported per system and method: useful (non-pad) tokens/s, step time, peak RSS of the process,
held-out loss of the final model (the same function, fp32, for both, judged after each run),
MFU against a matmul peak measured in the same run, and leantune's ratios to the baseline
(medians over the repetitions). Each run, judged, is appended to `<out>/runs.jsonl` as it
finishes. One JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from leantune.bench.chat_corpus import write_corpus
from leantune.bench.model_shapes import build_model, parameter_count
from leantune.bench.throughput_args import BASELINE_RESULT, HF_BATCH, add_arguments
from leantune.core import writes
from leantune.core.allocator import without_leantune_preload
from leantune.core.kernel_caches import without_leantune_kernel_caches
from leantune.core.openmp import without_leantune_wait_policy
from leantune.core.precision import resolve_precision
from leantune.data.dataset import prepared_data
from leantune.data.prepare.records import PrepareSettings
from leantune.errors import UserError
from leantune.eval.perplexity import evaluate_loss
from leantune.layout import RunPaths
from leantune.methods.artifacts import load_for_inference
from leantune.models.demo_model import ensure_demo_model
from leantune.models.loading import load_tokenizer, resolve_model
from leantune.monitor.metrics import read_metrics
from leantune.monitor.summary import finished_summary

Log = Callable[[str], None]
SYSTEMS = ("hf_trainer_peft", "leantune")
LEANTUNE_SAME = "leantune/same"
"""leantune with the baseline's updates (`--updates same`): a run's name in the log and order."""
RUNS_LOG = "runs.jsonl"
"""One line per judged run, appended as each finishes."""


def matmul_peak(dtype: str, threads: int, size: int = 1024, seconds: float = 1.0) -> float:
    """Sustained GFLOP/s of a square matmul in `dtype` ("fp32" or "bf16") on this CPU, now."""
    import torch

    torch.set_num_threads(threads)
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(size, size).to(kind)
    b = torch.randn(size, size).to(kind)
    a @ b  # warm-up (oneDNN picks its kernel)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * size**3 * n / (time.perf_counter() - start) / 1e9


def flops_per_token(model_dir: str, method: str, mean_len: float) -> float:
    """Training FLOPs per token: 2N forward over the matmul weights N (blocks and lm_head), plus
    2N for the input gradients and, for full fine-tuning, 2N for the weight gradients (6N;
    LoRA's adapters are negligible: 4N), plus causal attention (QK^T and AV over half the mean
    example length on average, forward and backward)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d, layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    kv = d * c.num_key_value_heads // c.num_attention_heads  # k/v width under grouped-query
    # q and o (d x d), k and v (d x kv), and the gated MLP's three d x inter matrices.
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * inter
    # Plus lm_head; the embedding is a lookup, no matmul.
    n = layers * per_layer + d * vocab
    matmul = (6 if method == "full" else 4) * n
    # 3 passes (forward, two backward matmuls) x 2 products (QK^T, AV) x 2 FLOPs per
    # multiply-add, each token attending to half the mean length on average (causal).
    attention = 3 * 2 * 2 * layers * d * (mean_len / 2)
    return float(matmul + attention)


def run_child(
    cmd: list[str],
    threads: int | None,
    extra_env: dict[str, str] | None = None,
    base_env: Mapping[str, str] | None = None,
) -> tuple[int, int, float, str]:
    """Run `cmd` (`base_env`, this environment by default, `extra_env` over it) with
    OMP_NUM_THREADS=`threads` (None: unset, the child chooses); its exit code, its own peak
    RSS in bytes, wall seconds, its output's tail."""
    base = os.environ if base_env is None else base_env
    # Both systems get the same thread count; the tokenizers' own pool is off so that it does
    # not compete with torch's threads.
    env = {**base, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    if threads is None:
        del env["OMP_NUM_THREADS"]
    env.update(extra_env or {})
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    # Read to the end first: a child blocked on a full pipe would never exit.
    output = proc.stdout.read().decode(errors="replace")
    # wait4, not Popen.wait: it returns the child's own rusage, so the peak RSS is that
    # process's alone (RUSAGE_CHILDREN would be the largest of all children so far).
    _, status, usage = os.wait4(proc.pid, 0)
    # Popen did not reap it: set its code, so that it does not wait again or warn on delete.
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024, time.perf_counter() - started, output[-3000:]


def child_failure(label: str, code: int, output: str, out: Path) -> Exception:
    """What a benchmarked process that exited with `code` is raised as: the user's error when
    its output reports a full or read-only disk (named by the run's folder `out`), else an
    error whose first line is the process's own last line (its exception), then its output."""
    refused = writes.write_refusal_in_text(output)
    if refused is not None:
        return writes.library_refusal(out, refused)
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    return RuntimeError(f"{label} failed (exit {code}): {last}\n{output}")


def leantune_command(
    model: str,
    train: Path,
    method: str,
    run_dir: Path,
    precision: str = "auto",
    same_updates: bool = False,
) -> list[str]:
    """leantune's command: its defaults, and `train.precision` only when the benchmark was
    asked for one precision (`--precision`) rather than what each system runs fastest. With
    `same_updates`, the baseline's updates: HF_BATCH examples each, one per row."""
    # The baseline's LoraConfig, given explicitly so that the two cannot drift apart.
    lora = ["method.r=16", "method.alpha=32"] if method == "lora" else []
    chosen = [] if precision == "auto" else [f"train.precision={precision}"]
    if same_updates:
        # Unpacked rows make "examples per update" exact (a packed row holds a varying
        # number), and micro-batch 1 keeps them unpadded: HF_BATCH rows per update, so
        # ceil(examples / HF_BATCH) updates, as the baseline's.
        chosen += ["data.pack=false", "train.micro_batch_size=1", f"train.grad_accum={HF_BATCH}"]
    # No evaluation, report or progress bar during the run: work the baseline does not do (both
    # are judged afterwards, by the same function, outside the timed training).
    return [
        sys.executable, "-m", "leantune", "train", f"model.path={model}", f"data.train={train}",
        "data.format=chat", "data.eval=null", "train.eval_exact_match=false",
        f"method.name={method}", *lora, "train.lr=2e-4", "train.epochs=1", f"run.dir={run_dir}",
        "run.resume=never", "run.progress=false", "monitor.report=false", *chosen,
    ]  # fmt: skip


def hf_command(
    model: str, train: Path, method: str, out: Path, precision: str, threads: int, micro: int
) -> list[str]:
    """The baseline's command: batches of `HF_BATCH` examples per update, in micro-batches of
    `micro` (gradient accumulation makes up the rest: the same updates, the same schedule)."""
    return [
        sys.executable, "-m", "leantune.bench.hf_baseline", "--model", model, "--train",
        str(train), "--out", str(out), "--method", method, "--precision", precision,
        "--threads", str(threads), "--batch-size", str(micro),
        "--grad-accum", str(HF_BATCH // micro),
    ]  # fmt: skip


def baseline_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without what the leantune command set in it for itself (`core.allocator`'s
    preload, `core.openmp`'s wait policy, `core.kernel_caches`' capacities): what a
    baseline's user would run with."""
    return without_leantune_kernel_caches(
        without_leantune_wait_policy(without_leantune_preload(environ))
    )


def leantune_result(run_dir: Path) -> dict[str, Any]:
    """A finished leantune run's time, steps, useful tokens, precision and allocator."""
    paths = RunPaths(run_dir)
    summary = finished_summary(run_dir)
    metrics = read_metrics(paths.metrics)
    cfg = paths.config.read_text()
    return {
        "train_time_s": float(summary["train_time_s"]),
        "steps": int(summary["steps"]),
        "useful_tokens": sum(int(m["tokens"]) for m in metrics),
        # The saved config is the resolved one: it records what precision=auto chose.
        "precision": "bf16" if "precision: bf16" in cfg else "fp32",
        "allocator": summary.get("allocator", "glibc"),
    }


def one_run(
    system: str, method: str, work: Path, rep: int, ctx: dict[str, Any], log: Log
) -> dict[str, Any]:
    """Train once with `system` ("leantune", "leantune/same" for the baseline's updates, or the
    baseline's name); its result with the child's peak RSS."""
    same = system == LEANTUNE_SAME
    system = "leantune" if same else system
    out = work / f"{system}-{method}-{rep}{'-same' if same else ''}"
    if system == "leantune":
        asked = ctx["precision_asked"]
        cmd = leantune_command(ctx["model"], ctx["train"], method, out, asked, same)
    else:
        precision, threads, micro = ctx["precision"], ctx["threads"], ctx["hf_micro_batch"]
        cmd = hf_command(ctx["model"], ctx["train"], method, out, precision, threads, micro)
    # The baseline runs with the allocator and OpenMP wait policy its user would have: not the
    # ones the leantune command set in this process (a user's own stay).
    base = os.environ if system == "leantune" else baseline_environment(os.environ)
    code, rss, wall, tail = run_child(cmd, ctx["threads"], base_env=base)
    if code == -9 and system != "leantune":  # SIGKILL: the kernel's OOM killer, mostly
        # The baseline's batch of 8 not fitting this machine is the user's to choose around.
        raise UserError(
            f"the baseline ({system} {method} rep {rep}) was killed, most likely for memory at "
            f"peak RSS {rss / 2**30:.1f} GiB: lower its micro-batch (the same 8 examples per "
            f"update by accumulation), e.g. --hf-micro-batch {max(1, micro // 2)}"
        )
    if code != 0:
        raise child_failure(f"{system} {method} rep {rep}", code, tail, out)
    result = (
        leantune_result(out)
        if system == "leantune"
        else json.loads((out / BASELINE_RESULT).read_text())
    )
    result.update(system=system, method=method, rep=rep, peak_rss_bytes=rss, wall_s=wall)
    # Which comparison a leantune run belongs to; the baseline's runs belong to both.
    result["updates"] = ("same" if same else "defaults") if system == "leantune" else "baseline"
    result["useful_tokens_per_s"] = result["useful_tokens"] / result["train_time_s"]
    result["step_time_s"] = result["train_time_s"] / max(1, result["steps"])
    result["model_dir"] = str(RunPaths(out).final if system == "leantune" else out / "model")
    name = LEANTUNE_SAME if same else system
    log(
        f"{name:16s} {method:4s} rep {rep}: {result['useful_tokens_per_s']:.1f} useful tok/s, "
        f"{result['steps']} steps, peak RSS {rss / 2**30:.2f} GiB"
    )
    return result


WEIGHT_FOLDERS = ("checkpoints", "final", "model", "trainer")
"""What a run's folder holds of weights: leantune's checkpoints and final model, the
baseline's saved model and its Trainer's output."""


def drop_weights(run: Path) -> None:
    """Remove a judged run's weights (`WEIGHT_FOLDERS`); its config, metrics and summary stay."""
    for name in WEIGHT_FOLDERS:
        shutil.rmtree(run / name, ignore_errors=True)


def heldout_loss(model_dir: str, eval_file: Path, max_seq_len: int) -> float:
    """Mean loss per supervised token on the held-out conversations (fp32, unpacked)."""

    model, tokenizer = load_for_inference(model_dir)
    settings = PrepareSettings(format="chat", max_seq_len=max_seq_len, pack=False)
    data = prepared_data(eval_file, settings=settings, tokenizer=tokenizer, max_bad_fraction=1.0)
    return float(evaluate_loss(model, data.rows, int(tokenizer.pad_token_id), 8, "fp32")["loss"])


def _aggregate(runs: list[dict[str, Any]], updates: str = "defaults") -> dict[str, Any]:
    """Medians per (system, method) and leantune's ratios to the baseline, for leantune's runs
    of one comparison (`updates`: "defaults" or "same"; the baseline's runs serve both)."""
    table: dict[str, Any] = {}
    for method in sorted({r["method"] for r in runs}):
        row: dict[str, Any] = {}
        for system in SYSTEMS:
            mine = [
                r
                for r in runs
                if r["system"] == system
                and r["method"] == method
                and r.get("updates", updates) in (updates, "baseline")
            ]
            row[system] = {
                "useful_tokens_per_s": statistics.median(r["useful_tokens_per_s"] for r in mine),
                "step_time_s": statistics.median(r["step_time_s"] for r in mine),
                "steps": mine[0]["steps"],
                "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in mine),
                "heldout_loss": statistics.median(r["heldout_loss"] for r in mine),
                "mfu": statistics.median(r["mfu"] for r in mine),
                "padding_ratio": mine[0].get("padding_ratio"),
                "precision": mine[0]["precision"],
                "reps": len(mine),
            }
        base, ours = row["hf_trainer_peft"], row["leantune"]
        row["ratios"] = {
            "useful_tokens_per_s": ours["useful_tokens_per_s"] / base["useful_tokens_per_s"],
            "peak_rss": ours["peak_rss_bytes"] / base["peak_rss_bytes"],
            "heldout_loss": ours["heldout_loss"] / base["heldout_loss"],
            # 1.0 in the same-updates comparison; below 1 where leantune took fewer updates.
            "updates": ours["steps"] / base["steps"],
        }
        table[method] = row
    return table


def markdown(table: dict[str, Any]) -> str:
    """The README's table."""
    lines = [
        "| method | system | useful tok/s | step time (s) | updates | peak RSS (GiB) "
        "| held-out loss | MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, row in table.items():
        for system in SYSTEMS:
            r = row[system]
            lines.append(
                f"| {method} | {system} | {r['useful_tokens_per_s']:.1f} | {r['step_time_s']:.2f} "
                f"| {r['steps']} | {r['peak_rss_bytes'] / 2**30:.2f} | {r['heldout_loss']:.4f} "
                f"| {r['mfu']:.1%} |"
            )
        q = row["ratios"]
        lines.append(
            f"| {method} | ratio | {q['useful_tokens_per_s']:.2f}x | | {q['updates']:.2f}x "
            f"| {q['peak_rss']:.2f}x | {q['heldout_loss']:.3f}x | |"
        )
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace, log: Log = print) -> dict[str, Any]:
    """Generate the corpus, alternate the systems `args.reps` times, judge, aggregate."""

    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    (work / RUNS_LOG).write_text("")  # one line per finished run, as it finishes
    model, shape_facts = _model_to_train(args, work, log)
    tokenizer = load_tokenizer(resolve_model(model), False)
    lo, hi = args.min_tokens, args.max_tokens
    # Different seeds: the held-out conversations are not copies of the training ones.
    train = write_corpus(work / "train.jsonl", tokenizer, args.conversations, 0, lo, hi)
    heldout = write_corpus(work / "heldout.jsonl", tokenizer, args.heldout, 1, lo, hi)
    asked = args.precision
    precision = asked
    if asked == "auto":
        # What leantune's train.precision=auto picks here, given to the baseline too: bf16 on a
        # CPU without fast bf16 matmul would be unfair to it.
        precision = resolve_precision("auto", "cpu", None, "auto").precision
    # Both peaks: each run's MFU is against the peak of the precision it ran in.
    peaks = {p: matmul_peak(p, args.threads) for p in ("fp32", "bf16")}
    log(f"matmul peak: fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s")
    ctx = {
        "model": model,
        "train": train,
        "heldout": heldout,
        "precision": precision,
        "precision_asked": asked,
        "threads": args.threads,
        "hf_micro_batch": args.hf_micro_batch,
        "peaks": peaks,
    }
    # With the chat template's markup, as the model sees them: attention FLOPs grow with it.
    lengths = [_chat_tokens(tokenizer, json.loads(x)["messages"])
               for x in train.read_text().splitlines()]  # fmt: skip
    ctx["mean_len"] = mean_len = sum(lengths) / len(lengths)
    modes = ("defaults", "same") if args.updates == "both" else (args.updates,)
    runs = _alternate(args, modes, ctx, work, log)
    # Measured again after the runs: a peak read while something else ran for a moment (one
    # reading of 1 s) would make every MFU too high; the higher reading is this machine's.
    again = {p: matmul_peak(p, args.threads) for p in peaks}
    best = {p: max(peaks[p], again[p]) for p in peaks}
    log(f"matmul peak after the runs: fp32 {again['fp32']:.0f} GFLOP/s, bf16 {again['bf16']:.0f}")
    for r in runs:  # runs.jsonl keeps each run's MFU against the first reading
        r["mfu"] *= peaks[r["precision"]] / best[r["precision"]]
    result: dict[str, Any] = {
        "benchmark": "throughput_vs_hf",
        "model": args.model if args.model_shape is None else f"{args.model_shape} shape",
        **shape_facts,
        "conversations": args.conversations,
        "mean_tokens": mean_len,
        "threads": args.threads,
        "precision": precision,
        "precision_asked": asked,
        "hf_batch": {
            "micro_batch_size": args.hf_micro_batch,
            "grad_accum": HF_BATCH // args.hf_micro_batch,
        },
        "updates": args.updates,
        "matmul_peak_gflops": best,
        "matmul_peak_readings": {"before": peaks, "after": again},
        "cpu": cpu_name(),
    }
    for mode in modes:
        result[COMPARISONS[mode]] = _aggregate(runs, mode)
    result["runs"] = runs
    return result


COMPARISONS = {"defaults": "results", "same": "same_updates"}
"""Each `--updates` comparison's key in the result (`results`: defaults against defaults)."""


def _model_to_train(args: argparse.Namespace, work: Path, log: Log) -> tuple[str, dict[str, Any]]:
    """The model folder both systems train, and what the result says of a built one."""
    if args.model_shape is None:
        return resolve_model(args.model).location, {}
    shape = args.model_shape
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else ensure_demo_model()
    # Per tokenizer: a folder built with another one would hold another vocabulary.
    model_dir = build_model(shape, work / f"model-{shape}-{tokenizer_dir.name}", tokenizer_dir)
    n = parameter_count(model_dir)
    log(
        f"model: random weights of the {shape} shape ({n / 1e9:.2f}B parameters, the tokenizer "
        f"of {tokenizer_dir}), built from config, nothing downloaded: the held-out loss checks "
        "that both systems train alike (parity), it is not a quality figure"
    )
    facts = {"model_shape": shape, "weights": "random", "parameters": n}
    return str(model_dir), {**facts, "tokenizer": str(tokenizer_dir)}


def _alternate(
    args: argparse.Namespace, modes: Sequence[str], ctx: dict[str, Any], work: Path, log: Log
) -> list[dict[str, Any]]:
    """Every run, `args.reps` times per method, who goes first alternating; each judged (MFU
    and held-out loss) and appended to runs.jsonl as it finishes."""
    systems = [SYSTEMS[0]]
    systems += ["leantune"] if "defaults" in modes else []
    systems += [LEANTUNE_SAME] if "same" in modes else []
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for method in args.methods:
            for system in systems if rep % 2 == 0 else systems[::-1]:
                r = one_run(system, method, work, rep, ctx, log)
                per_token = flops_per_token(ctx["model"], method, ctx["mean_len"])
                peak = ctx["peaks"][r["precision"]]
                r["mfu"] = r["useful_tokens_per_s"] * per_token / (peak * 1e9)
                # Judged at once (between runs, outside what is timed): a stopped benchmark
                # leaves every finished run whole in runs.jsonl, its held-out loss included.
                r["heldout_loss"] = heldout_loss(r["model_dir"], ctx["heldout"], args.max_seq_len)
                if not args.keep_models:
                    drop_weights(Path(r["model_dir"]).parent)
                runs.append(r)
                with (work / RUNS_LOG).open("a") as f:
                    f.write(json.dumps(r) + "\n")
    return runs


def _chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text)["input_ids"])


def cpu_name() -> str:
    """This CPU's model name, from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leantune bench throughput",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)
    return p


def report(args: argparse.Namespace) -> int:
    """Run the benchmark; the tables on stderr, one JSON line on stdout."""
    result = run_benchmark(args, log=lambda m: print(m, file=sys.stderr))
    titles = {
        "results": "leantune's defaults against the baseline's",
        "same_updates": f"the same updates: {HF_BATCH} examples per update for both",
    }
    for key, title in titles.items():
        if key in result:
            print(f"\n{title}\n\n{markdown(result[key])}", file=sys.stderr)
    if result.get("weights") == "random":
        print(
            f"\nweights: random ({result['model']}); held-out loss = parity check", file=sys.stderr
        )
    print(json.dumps(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return report(parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
