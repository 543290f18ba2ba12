"""The memory planner's inputs, read from a run's config in one place (`plan_inputs`)."""

from __future__ import annotations

from leantune.config import Config, configured_global_batch
from leantune.memory.inputs import PlanInputs
from leantune.methods.checks import effective_pack


def plan_inputs(cfg: Config) -> PlanInputs:
    """What the memory planner reads of `cfg`, with the settings it decides (auto) as None and
    data.pack as the method resolves it."""
    m, d, t = cfg.model, cfg.data, cfg.train
    return PlanInputs(
        model_path=m.path,
        gguf_file=m.gguf_file,
        model_dtype=m.dtype,
        trust_remote_code=m.trust_remote_code,
        attn_implementation=m.attn_implementation,
        method=cfg.method,
        # Resolved here, not left auto: packing changes the rows' lengths the planner sizes.
        pack=effective_pack(d.pack, cfg.method.name),
        max_seq_len=None if d.max_seq_len == "auto" else d.max_seq_len,
        micro_batch=None if t.micro_batch_size == "auto" else t.micro_batch_size,
        grad_accum=t.grad_accum,
        global_batch=configured_global_batch(t),
        gradient_checkpointing=(
            None if t.gradient_checkpointing == "auto" else t.gradient_checkpointing
        ),
        precision=t.precision,
        optimizer=t.optimizer,
        kl=t.kl_coef > 0,
        memory_budget=t.memory_budget,
        objective=t.objective,
        reference=t.reference,
    )
