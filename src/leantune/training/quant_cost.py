"""What a base quantised while it loads (QLoRA's 4-bit NF4) costs before any training: the base
model's held-out loss in its own precision (model.dtype) and in 4-bit, on the first few held-out
examples, for `leantune plan` and the run log.

One copy of the weights at a time: the base is loaded in its own precision and measured, freed,
then loaded quantised (the run trains that one) and measured again; the loss is the held-out
loss of `eval.perplexity.evaluate_loss`, the quantisation `models.quantize`'s.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from leantune.config import Config
from leantune.core.precision import pick_device, resolve_precision
from leantune.data.dataset import PreparedData, prepared_data
from leantune.data.packing import Row, single_rows
from leantune.data.prepare.records import PrepareSettings
from leantune.data.templates import apply_chat_template
from leantune.eval.perplexity import evaluate_loss
from leantune.methods.registry import METHODS, base_quantization, compute_dtype
from leantune.models.loading import ModelSource, load_tokenizer, resolve_model
from leantune.models.quantize import Quantization
from leantune.training.build import base_model
from leantune.training.run_setup import RunSetup, auto_context, tokenise_limit

Log = Callable[[str], None]

COST_EXAMPLES = 8
"""Held-out examples the cost is measured on: a few forwards of each model, not an evaluation."""


@dataclass(frozen=True)
class QuantCost:
    """The base model's held-out loss before training, in its own precision and quantised."""

    examples: int
    """Held-out examples measured (the first ones of data.eval)."""
    own_dtype: str
    """model.dtype: the precision of the unquantised base."""
    own_loss: float
    quantized_loss: float
    quant_type: str
    """The 4-bit format (nf4, fp4)."""
    precision: str
    """The resolved train.precision: the autocast both forwards ran under."""

    def line(self, method: str) -> str:
        """The sentence the run log and `leantune plan` print."""
        diff = self.quantized_loss - self.own_loss
        share = f", {diff / self.own_loss:+.1%}" if self.own_loss > 0 else ""
        return (
            f"method.name={method}: the base model's held-out loss before training, on the first "
            f"{self.examples} held-out examples: {self.own_loss:.4f} in {self.own_dtype} "
            f"(model.dtype), {self.quantized_loss:.4f} in 4-bit {self.quant_type.upper()} "
            f"({diff:+.4f}{share}; both with train.precision={self.precision}): what the 4-bit "
            f"base costs before any training. {TURN_OFF}"
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data for `leantune plan --json`."""
        return {"measured": True, **asdict(self)}


NO_EVAL = (
    "data.eval is not set (give held-out data to see the base model's loss in 4-bit and in "
    f"model.dtype before training, on its first {COST_EXAMPLES} examples)"
)
NO_ROOM = "the base in model.dtype does not fit in device memory (the 4-bit base is what trains)"
TURN_OFF = "method.measure_quant_cost=false skips this measurement (it loads the base twice)"
"""Said with every measured cost: for a large model the measurement takes minutes."""
TURNED_OFF = "method.measure_quant_cost=false"
"""Why the cost is not measured when the config turned it off."""


def not_measured(method: str, why: str) -> str:
    """The line said instead of the cost, with why it is not measured."""
    return f"method.name={method}: the 4-bit base's cost is not measured: {why}"


def cost_rows(data: PreparedData) -> list[Row]:
    """The first `COST_EXAMPLES` held-out examples, one per row (packed rows would mix them)."""
    return single_rows(data.examples[:COST_EXAMPLES])


def measure(
    cfg: Config,
    source: ModelSource,
    quantization: Quantization,
    rows: list[Row],
    pad_id: int,
    device: torch.device,
    run: RunSetup | None = None,
    log: Log | None = None,
) -> tuple[QuantCost, nn.Module]:
    """The base's held-out loss on `rows` in model.dtype, then (after freeing that copy) in
    4-bit; returns the cost and the quantised base, loaded as `build.base_model` loads it (with
    `run`, its ids checked; `log` hears its warnings). `cfg`'s precision must be resolved."""
    t = cfg.train
    own = base_model(cfg, source, None, device)
    own_loss = evaluate_loss(own, rows, pad_id, t.eval_batch_size, t.precision, device)["loss"]
    # Freed before the 4-bit load: one copy of the weights in memory at a time.
    del own
    gc.collect()
    model = base_model(cfg, source, quantization, device, run, log or (lambda _: None))
    q_loss = evaluate_loss(model, rows, pad_id, t.eval_batch_size, t.precision, device)["loss"]
    q_type = quantization.quant_type
    cost = QuantCost(len(rows), cfg.model.dtype, own_loss, q_loss, q_type, t.precision)
    return cost, model


def load_base(
    cfg: Config,
    source: ModelSource,
    quantization: Quantization | None,
    device: torch.device,
    run: RunSetup,
    pad_id: int,
    log: Log,
) -> nn.Module:
    """The run's base model (`build.base_model`); a fresh run whose base is quantised while it
    loads also logs what that costs, measured on the first held-out examples (`measure`), or why
    it is not measured."""
    if quantization is None or run.plan.action != "fresh":
        return base_model(cfg, source, quantization, device, run, log)
    if not cfg.method.measure_quant_cost:
        log(not_measured(cfg.method.name, TURNED_OFF))
        return base_model(cfg, source, quantization, device, run, log)
    if run.eval_data is None or not run.eval_data.examples:
        log(not_measured(cfg.method.name, NO_EVAL))
        return base_model(cfg, source, quantization, device, run, log)
    rows = cost_rows(run.eval_data)
    try:
        cost, model = measure(cfg, source, quantization, rows, pad_id, device, run, log)
    except torch.OutOfMemoryError:
        # The run itself never holds the unquantised base: its lack of room is no reason to stop.
        gc.collect()
        torch.cuda.empty_cache()
        log(not_measured(cfg.method.name, NO_ROOM))
        return base_model(cfg, source, quantization, device, run, log)
    log(cost.line(cfg.method.name))
    return model


def plan_cost(cfg: Config) -> dict[str, Any] | None:
    """`leantune plan`'s cost of a base quantised while it loads, measured on this machine (the
    device and precision `train` would resolve): the `QuantCost` as plain data with its `line`,
    {"measured": False, "line": why} without held-out examples, or None when the method does not
    quantise its base."""
    if METHODS[cfg.method.name].base_quantization is None:
        return None
    d, method = cfg.data, cfg.method.name
    if not cfg.method.measure_quant_cost:
        return {"measured": False, "line": not_measured(method, TURNED_OFF)}
    if d.eval is None:
        return {"measured": False, "line": not_measured(method, NO_EVAL)}
    source = resolve_model(cfg.model.path, cfg.model.gguf_file)
    # As set-up resolves them, without a run directory to read a recorded precision from.
    try:
        device = pick_device(cfg.train.device)
    except ValueError as e:  # train.device=cuda, planned on a machine without one
        return {"measured": False, "line": not_measured(method, str(e))}
    precision = resolve_precision(cfg.train.precision, device.type, None, compute_dtype(cfg.method))
    cfg = replace(cfg, train=replace(cfg.train, precision=precision.precision))
    quantization = base_quantization(cfg.method, cfg.train.precision)
    assert quantization is not None, "the method's spec quantises its base"
    tokenizer = load_tokenizer(source, cfg.model.trust_remote_code)
    apply_chat_template(tokenizer, d.chat_template)
    limit = tokenise_limit(d, auto_context(cfg, source))
    # Unpacked, uncleaned, every line accepted and no cache: `plan` writes nothing.
    settings = PrepareSettings(d.format, limit, False, d.system_prompt, d.system_message)
    data = prepared_data(
        d.eval, settings=settings, tokenizer=tokenizer, max_bad_fraction=1.0, limit=COST_EXAMPLES
    )
    if not data.examples:
        return {"measured": False, "line": not_measured(method, f"{d.eval} has no examples")}
    pad_id = int(tokenizer.pad_token_id)
    try:
        cost, _ = measure(cfg, source, quantization, cost_rows(data), pad_id, device)
    except torch.OutOfMemoryError:
        return {"measured": False, "line": not_measured(method, NO_ROOM)}
    return {**cost.as_dict(), "line": cost.line(method)}
