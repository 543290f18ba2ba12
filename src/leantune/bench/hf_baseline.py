"""The baseline of `leantune bench throughput`: HF Trainer + PEFT as a user configures it.

Run as `python -m leantune.bench.hf_baseline ...` in its own process (so its peak RSS is its
own). It trains on exactly the examples leantune trains on (the same tokenisation and answer
masks, from leantune's prepare pipeline without packing), with Trainer's usual set-up for
labelled SFT: a padding collator (`DataCollatorForSeq2Seq`), shuffled batches, `use_cpu=True`,
cosine schedule, one epoch. It writes `result.json` (train time, tokens with and without
padding, steps, peak RSS) and the trained model, merged into its base, for the held-out loss.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from leantune.bench.throughput_args import BASELINE_RESULT
from leantune.core.allocator import mapped_allocator
from leantune.core.writes import write_file
from leantune.data.dataset import prepared_data
from leantune.data.prepare.records import PrepareSettings
from leantune.data.tokenize import IGNORE_INDEX


def _rows(path: Path, tokenizer: Any, max_seq_len: int) -> list[dict[str, list[int]]]:

    settings = PrepareSettings(format="chat", max_seq_len=max_seq_len, pack=False)
    # Never refuse: keep what leantune's pipeline keeps, however many lines it drops.
    data = prepared_data(path, settings=settings, tokenizer=tokenizer, max_bad_fraction=1.0)
    # leantune stores labels shifted (labels[i] is the target of position i); transformers'
    # loss shifts the labels it gets, so it gets them unshifted: the target of position i
    # at i + 1. Passed as they are, every position would learn the token two ahead.
    return [
        {
            "input_ids": [int(t) for t in r.input_ids],
            "labels": [IGNORE_INDEX, *(int(t) for t in r.labels[:-1])],
            "attention_mask": [1] * len(r.input_ids),  # unpadded: the collator pads per batch
        }
        for r in data.rows
    ]


class CountingCollator:
    """`DataCollatorForSeq2Seq` that also counts the tokens it hands out, padded and not."""

    def __init__(self, tokenizer: Any):
        from transformers import DataCollatorForSeq2Seq

        # -100: the label the loss ignores, so the padding teaches nothing.
        self.inner = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        self.useful = 0
        self.processed = 0

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.inner(features)
        self.useful += int(batch["attention_mask"].sum())
        self.processed += int(batch["input_ids"].numel())
        return batch


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train once; returns the result (also written to `<out>/result.json`)."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # Many causal LMs ship without a pad token, which the padding collator needs; the mask and
    # the -100 labels keep it out of attention and the loss.
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = _rows(Path(args.train), tokenizer, args.max_seq_len)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.method == "lora":
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    collator = CountingCollator(tokenizer)
    targs = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,  # a ratio below 1 (transformers 5)
        num_train_epochs=1,
        max_steps=args.max_steps,  # -1: the epoch; a short benchmark run caps it
        bf16=args.precision == "bf16",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",  # checkpoint writes would count as training time
        report_to="none",
        seed=args.seed,
        # In this process: a worker's memory would escape the peak RSS measured here.
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=Dataset.from_list(rows),
        data_collator=collator,
    )
    started = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - started
    # Merged into its base: the held-out judge then loads one plain model folder.
    merged = model.merge_and_unload() if args.method == "lora" else model
    merged.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    result = {
        "system": "hf_trainer_peft",
        "method": args.method,
        "precision": args.precision,
        # Trainer's own timing of its training loop; the wall time only if it is missing.
        "train_time_s": float(output.metrics.get("train_runtime", wall)),
        "steps": int(output.global_step),
        "useful_tokens": collator.useful,
        "processed_tokens": collator.processed,
        "padding_ratio": 1 - collator.useful / max(1, collator.processed),
        "peak_rss_bytes": int(rss),
        "examples": len(rows),
        "micro_batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
    }
    result["allocator"] = mapped_allocator()[0]
    write_file(out / BASELINE_RESULT, json.dumps(result, indent=2))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="a model directory (HF layout)")
    p.add_argument("--train", required=True, help="chat JSONL")
    p.add_argument("--out", required=True)
    p.add_argument("--method", choices=("lora", "full"), default="lora")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--batch-size", type=int, default=8, help="per-device (micro) batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=-1, help="updates at most (-1: one epoch)")
    print(json.dumps(run(p.parse_args(argv))))


if __name__ == "__main__":
    main()
