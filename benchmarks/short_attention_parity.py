"""The short-segment attention kernel against torch's flash kernel on the demo model: each one's
distance from fp32, in bf16 autocast, on one packed row of the demo's first conversations.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/short_attention_parity.py [--examples 4]

The demo model (SmolLM2-135M, its real weights) with segment attention, the loss summed over
every token of one row packed from the first `--examples` demo conversations and the
gradients of every weight: in fp32 (the reference), in bf16 autocast with the short kernel
(`models.short_attention`, the default for segments <= `SHORT_SEGMENT` tokens) and with the
flash kernel. Reported: each bf16 loss's relative error and the relative L2 error of all
gradients together. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=4)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import leantune
    import leantune.models.attention as attention
    from leantune.models.demo_model import ensure_demo_model
    from leantune.models.loss import token_loss_sum

    torch.set_num_threads(1)
    path = ensure_demo_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    model.set_attn_implementation(attention.register_segment_attention())
    demo = Path(leantune.__file__).parent / "demo" / "data" / "support_train.jsonl"
    ids: list[int] = []
    pos: list[int] = []
    lengths = []
    for line in demo.read_text().splitlines()[: args.examples]:
        t = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True)
        t = list(t["input_ids"] if hasattr(t, "keys") else t)
        ids, pos, lengths = ids + t, pos + list(range(len(t))), [*lengths, len(t)]
    x = torch.tensor([ids])
    batch = {"input_ids": x, "labels": x.clone(), "position_ids": torch.tensor([pos])}

    def run(bf16: bool) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = token_loss_sum(model, batch)
        loss.backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        return float(loss.detach()), torch.cat(grads)

    ref_loss, ref_grads = run(False)
    sides = {"short": run(True)}
    attention.SHORT_SEGMENT = 0
    sides["flash"] = run(True)
    line: dict[str, Any] = {"benchmark": "short_attention_parity", "segments": lengths}
    line["fp32_loss"] = ref_loss
    print(f"{'bf16 kernel':12} {'loss':>12} {'loss rel err':>13} {'grads rel L2 err':>17}")
    for name, (loss, grads) in sides.items():
        err = abs(loss - ref_loss) / abs(ref_loss)
        gerr = float((grads - ref_grads).norm() / ref_grads.norm())
        line[name] = {"loss": loss, "loss_rel_err": err, "grads_rel_l2_err": gerr}
        print(f"{name:12} {loss:12.4f} {err:13.2e} {gerr:17.2e}")
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
