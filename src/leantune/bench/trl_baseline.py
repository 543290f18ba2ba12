"""The baseline of `leantune bench preference`: TRL's `DPOTrainer` as a user configures it.

Run as `python -m leantune.bench.trl_baseline ...` in its own process (so its peak RSS is its
own). It reads the same pairs file leantune trains on and hands the records to `DPOTrainer`
unchanged (TRL tokenises them with the model's chat template), with a `peft_config`, so that TRL
takes its default reference for PEFT (the same model with the adapter disabled), its own padding
collator (`DataCollatorForPreference`), `use_cpu=True`, the cosine schedule. It writes
`result.json` (train time, tokens with and without padding, steps, peak RSS) and the trained
model, merged into its base, for the held-out preference accuracy.
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


class CountingCollator:
    """TRL's collator, counting the tokens of each batch it hands out, padded and not."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.useful: list[int] = []
        self.processed: list[int] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.inner(features)
        self.useful.append(int(batch["attention_mask"].sum()))
        self.processed.append(int(batch["input_ids"].numel()))
        return batch


def _trainer(args: argparse.Namespace, tokenizer: Any, records: list[dict[str, Any]]) -> Any:
    """`DPOTrainer` with the benchmark's settings; everything else TRL's defaults."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # leantune's LoRA default (its preset): every linear layer of the blocks, r 16, alpha 32.
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    config = DPOConfig(
        output_dir=str(Path(args.out) / "trainer"),
        beta=args.beta,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        # leantune's schedule: 10% linear warm-up, cosine down to 10% of the peak.
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=0.1,  # a ratio below 1 (transformers 5)
        weight_decay=0.01,  # leantune's default; TRL's is 0
        num_train_epochs=1,
        max_steps=args.max_steps if args.max_steps is not None else -1,
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
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
        peft_config=lora,
    )
    # TRL built its own collator; counting wraps it, the batches stay TRL's.
    trainer.data_collator = CountingCollator(trainer.data_collator)
    return trainer


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train once; returns the result (also written to `<out>/result.json`)."""
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    records = [json.loads(x) for x in Path(args.train).read_text().splitlines() if x.strip()]
    trainer = _trainer(args, tokenizer, records)
    started = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - started
    # Merged into its base: the judge then loads one plain model folder.
    merged = trainer.model.merge_and_unload()
    merged.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    collator = trainer.data_collator
    # accelerate's data loader collates one batch ahead (to know which is last): with
    # --max-steps, the batch after the last step was collated but never trained on.
    steps = int(output.global_step)
    useful, processed = sum(collator.useful[:steps]), sum(collator.processed[:steps])
    result = {
        "system": "trl_dpo",
        "precision": args.precision,
        # Trainer's own timing of its training loop; the wall time only if it is missing.
        "train_time_s": float(output.metrics.get("train_runtime", wall)),
        "steps": steps,
        "useful_tokens": useful,
        "processed_tokens": processed,
        "padding_ratio": 1 - useful / max(1, processed),
        "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
        "peak_rss_bytes": int(rss),
        "pairs": len(records),
        "batch_pairs": args.batch_size,
        "allocator": mapped_allocator()[0],
    }
    write_file(out / BASELINE_RESULT, json.dumps(result, indent=2))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="a model directory (HF layout)")
    p.add_argument("--train", required=True, help="preference pairs (JSONL, TRL's formats)")
    p.add_argument("--out", required=True)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=4, help="pairs per update")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N updates")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(run(p.parse_args(argv))))


if __name__ == "__main__":
    main()
