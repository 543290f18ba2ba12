"""Peak memory of one training step, from model facts and run settings: the arithmetic in one place.

What the loop keeps alive (training/recipe.py, training/token_loss.py):
- weights, plus optimizer states once the first step has run;
- during backward of a micro-batch: every tensor autograd saved in forward (per block below),
  plus the loss's transient: `token_loss_sum` projects only supervised positions onto the
  vocabulary, and cross-entropy's backward holds three (n_supervised x vocab) fp32 tensors
  (log-softmax output, its incoming gradient and the outgoing one);
- gradients are set to None after every optimizer step, so they never coexist with a full set of
  saved activations: they peak at the end of backward and during `optimizer.step`, whose
  single-tensor AdamW (the CPU default) makes two temporaries the size of the largest parameter.
So: peak = overhead + weights + reference copy + optimizer
           + max(activations + max(loss, recomputed block, reference),
                 gradients + step temporaries).

A preference objective (objectives/batch.py) adds the reference model's forward, without grad:
with an adapter method it runs on every micro-batch after the policy's forward, whose saved
activations are alive meanwhile (`reference`); full and freeze run it once over the data before
training instead, with no optimizer state or gradients yet (`Breakdown.reference_pass`), and
keep one float per sequence; or, with train.reference=live, keep a frozen copy of the weights
for the whole run (`Breakdown.reference_copy`) and run it on every micro-batch as adapters do.

Those are live tensors; what a run needs is more (`Breakdown.needed`): the allocator's share
(`FIT_MARGIN`, by allocator), and before training the load phase (`load_bytes`), when the
weights are built from the checkpoint's files.

Per block and token, what autograd keeps (Llama/Qwen2/Mistral code, checked by counting saved
tensors with `torch.autograd.graph.saved_tensors_hooks` on CPU): each RMSNorm keeps its input
(and the normalised input when its weight trains); a linear keeps its input only when its weight
or a LoRA/DoRA adapter trains; SDPA keeps q, k, v (GQA heads expanded when a mask exists, which
packed rows always have), its output, a log-sum-exp and its own float copy of the mask
(`segments`, causal SDPA per example, builds no mask at all: models/attention.py); eager
attention keeps the probabilities (heads x seq_len per token) instead; the SwiGLU MLP keeps
gate, up and silu(gate). With gradient checkpointing a block keeps only its input, and one
block's tensors are recomputed at a time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from leantune.core.chunked_ce import CHUNK
from leantune.memory.facts import ATTN_INPUT, MLP_INPUT, LayerTraining, ModelFacts, ModelShape
from leantune.models.short_attention import SHORT_SEGMENT

GIB = 1024**3

# Bytes of optimizer state per trainable parameter, for states stored at the parameter's dtype
# (None) or in a fixed number of bytes (8-bit: two 1-byte states; 4-bit: two half-byte states;
# their per-block scales add under 2%).
OPTIMIZER_STATE_BYTES: dict[str, float | None] = {
    "adamw": None,
    "adamw_8bit": 2.0,
    "paged_adamw_8bit": 2.0,
    "adamw_4bit": 1.0,
}

# Bytes per quantised linear weight: NF4 packs two weights per byte plus one fp32 absmax per
# 64-weight block; double quantisation stores those absmax in 8 bits with one fp32 per 256.
QUANT_BYTES: dict[str, float] = {
    "nf4": 0.5 + 4 / 64,
    "nf4-dq": 0.5 + 1 / 64 + 4 / (64 * 256),
}

# Process baseline that is not the run's tensors: python + torch + transformers + peft imported
# and one warm-up step run (kernel code paged in; CPU RSS measured on this machine: 0.46 GiB),
# or the CUDA context plus cuBLAS workspace on a GPU (typical 0.3-0.6 GiB; not measured here).
RUNTIME_OVERHEAD = {"cpu": int(0.46 * GIB), "cuda": int(0.5 * GIB)}

FIT_MARGIN: dict[str, float] = {"glibc": 1.7, "tcmalloc": 1.2, "cuda": 1.1, "cuda-4bit": 1.6}
"""Measured peak / predicted peak that a plan must leave room for before it "fits", by the CPU
allocator the run has (`core.allocator`: tcmalloc where installed) or on CUDA.

glibc's malloc: peak RSS ran 1.08x (0.4B full), 1.28x (0.4B LoRA), 1.36x (1.4B LoRA) and 1.65x
(6.9B QLoRA, anonymous memory) the prediction in issue 31's table (Qwen2.5 shapes, seq_len 512),
and 1.4-1.7x on benchmarks/plan_accuracy.py's grid: freed blocks stay in the heap and MKL keeps
scratch buffers. A 1.4B full run planned at 21.67 GiB "fitting" 22 GiB was killed at 23.9 GB.
1.7 covers every ratio measured. Another allocator (jemalloc, mimalloc) is not measured and
gets glibc's margin.
tcmalloc: the training peak ran 1.05x (0.4B full), 1.07x (0.4B LoRA), 1.05x (1.4B LoRA) and
1.13x (6.9B QLoRA) the prediction for the run's own micro-batch
(benchmarks/results/scale-cpu.json, 2-core AVX512-BF16 Xeon): 1.2 covers them with room.
CUDA: the caching allocator's reserved peak (what an out-of-memory is about) ran 1.04x (0.4B
full) and 1.02x (1.4B LoRA) the prediction, 0.64x for LoRA on a 6.9B's bf16 weights, but 1.29x
(1.4B) and 1.54x (6.9B) with a 4-bit base, whose bitsandbytes buffers the model does not count
(benchmarks/results/scale-cuda.json, one H200, bf16 autocast): 1.1, and 1.6 for a 4-bit base."""

MARGIN_MEASURED: dict[str, str] = {
    "glibc": "glibc's malloc: RSS measured 1.08x-1.65x the live tensors",
    "tcmalloc": "tcmalloc: RSS measured 1.05x-1.13x the live tensors",
    "cuda": "CUDA: reserved memory measured 0.64x-1.04x the live tensors",
    "cuda-4bit": "CUDA, 4-bit base: reserved memory measured 1.29x-1.54x the live tensors",
}
"""What the plan says about its margin, by allocator (see FIT_MARGIN)."""


def margin_key(device: str, allocator: str, quantised: bool = False) -> str:
    """Which `FIT_MARGIN` a run on `device` ("cpu", "cuda") has: its CPU `allocator`'s, or on
    CUDA the one for a 4-bit (`quantised`) base or any other."""
    if device == "cuda":
        return "cuda-4bit" if quantised else "cuda"
    return allocator if allocator in FIT_MARGIN else "glibc"


def fit_margin(device: str, allocator: str, quantised: bool = False) -> float:
    """`FIT_MARGIN` for a run on `device` with the CPU `allocator` it has (see `margin_key`)."""
    return FIT_MARGIN[margin_key(device, allocator, quantised)]


@dataclass(frozen=True)
class StepSettings:
    """The run settings that size a step's memory."""

    micro_batch: int
    seq_len: int
    supervised_per_row: int | None = None
    """Most supervised (labelled) tokens in one row; None = every position (the worst case)."""
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    precision: str = "fp32"
    """Autocast precision: fp32 (none), bf16 or fp16."""
    optimizer: str = "adamw"
    weight_quant: str | None = None
    """None, "nf4" or "nf4-dq" (4-bit base weights, as QLoRA)."""
    kl: bool = False
    """The KL-to-base term (train.kl_coef > 0) adds a second set of logits."""
    device: str = "cpu"
    allocator: str = "glibc"
    """The CPU allocator of the run's process (`core.allocator.mapped_allocator` names)."""
    checkpoint_bytes: int = 0
    """Bytes of the checkpoint's weight files (0: unknown, and the load phase is not modelled)."""
    checkpoint_itemsize: int | None = None
    """Bytes per weight in those files (None: the run's weight dtype; 0: converted on load, as
    GGUF's quantised blocks are)."""
    checkpoint_streamed: bool = False
    """Loading reads the files tensor by tensor (`models.weight_files`), not memory-mapped."""
    reference: Literal["none", "forward", "precomputed", "live"] = "none"
    """A preference objective's reference (or KTO's KL estimate): "forward", a forward without
    grad on every micro-batch (adapters off); "precomputed", one pass over the data before
    training (full, freeze), `reference_rows` rows at a time; "live", a frozen copy of the
    weights run forward on every micro-batch (full, freeze with train.reference=live)."""
    reference_rows: int = 0
    """Rows per forward of the precomputed reference pass."""


@dataclass(frozen=True)
class Breakdown:
    """Predicted bytes per component; `peak` combines them as the step does."""

    overhead: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    loss: int
    recompute: int
    step_temporaries: int
    load: int = 0
    """Peak of the load phase (`load_bytes`), runtime included; 0 when not modelled."""
    reference: int = 0
    """Transient of the reference's forward without grad on every micro-batch (0: none)."""
    reference_pass: int = 0
    """Peak of the reference pass before training, runtime and weights included (0: none)."""
    reference_copy: int = 0
    """The frozen copy of the weights train.reference=live keeps for the whole run (0: none)."""
    margin: float = 1.0
    """`FIT_MARGIN` of the device: how far above `peak` the process was measured to go."""

    @property
    def needed(self) -> int:
        """Memory the run needs: the step's peak with the allocator's margin, or the load
        phase's peak when that is higher. A plan fits a budget when this does."""
        # The reference pass is live tensors, as the step is, so it gets the same margin.
        live = max(self.peak, self.reference_pass)
        return max(int(live * self.margin + 0.5), self.load)

    @property
    def backward_phase(self) -> int:
        """Kept activations plus the largest of the loss transient (start of backward), with
        checkpointing one recomputed block (later, when the loss tensors are freed), and the
        reference's forward (before the loss, after the policy's forward)."""
        return self.activations + max(self.loss, self.recompute, self.reference)

    @property
    def update_phase(self) -> int:
        """Gradients and AdamW's temporaries, alive together during `optimizer.step`."""
        return self.gradients + self.step_temporaries

    @property
    def run_peak(self) -> int:
        """Peak of the run's own tensors, above the process baseline."""
        # max, not a sum: gradients are set to None after every optimizer step, so they never
        # coexist with a full set of saved activations.
        weights = self.weights + self.reference_copy
        return weights + self.optimizer + max(self.backward_phase, self.update_phase)

    @property
    def peak(self) -> int:
        """Predicted peak memory of the process."""
        return self.overhead + self.run_peak

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "run_peak": self.run_peak, "peak": self.peak, "needed": self.needed}


def activation_bytes_per_token(layer: LayerTraining, s: ModelShape, st: StepSettings) -> float:
    """Bytes one token leaves saved for backward in one transformer block (no checkpointing)."""
    act = 4 if st.precision == "fp32" else 2
    h, i, d = s.hidden, s.intermediate, s.head_dim
    q = s.heads * d
    # Rows with a mask give SDPA GQA heads expanded (repeat_kv); segment attention passes the
    # grouped heads as they are (enable_gqa), so only those are saved.
    kv = s.kv_heads * d if st.attn_implementation == "segments" else q
    elems = 2 * h  # each RMSNorm keeps its input (the residual stream)
    elems += 2 * h if layer.norms_train else 0
    attn_savers = len(layer.saves_input & set(ATTN_INPUT))
    mlp_savers = len(layer.saves_input & set(MLP_INPUT))
    if st.precision == "fp32":  # q/k/v (gate/up) keep the one input they share
        elems += h * min(attn_savers, 1) + h * min(mlp_savers, 1)
    else:  # autocast casts the shared input once per linear, and each keeps its own copy
        elems += h * (attn_savers + mlp_savers)
    elems += q + 2 * kv + q  # attention keeps q, k, v and its output
    # o_proj's input is a view of SDPA's output (already counted); eager attention copies it.
    eager = st.attn_implementation == "eager"
    elems += q if "o_proj" in layer.saves_input and eager else 0
    elems += 3 * i  # silu keeps gate; gate * up keeps silu(gate) and up
    elems += i if "down_proj" in layer.saves_input else 0
    elems += sum(s.kv_heads * d for _ in layer.saves_output)
    elems += layer.lora_rank_sum + 2 * layer.dora_out_features
    out = elems * act + layer.dropout_in_features * (act + 1)  # dropout: copy + bool mask
    out += 2 * 4  # RMSNorm's fp32 rsqrt per norm
    if st.precision != "fp32":
        out += 2 * h * 4  # RMSNorm upcasts its input to fp32 under autocast and keeps it
    if eager:
        out += s.heads * st.seq_len * act - q * act  # probabilities instead of SDPA's output
    elif st.attn_implementation == "segments":
        out += s.heads * 4  # log-sum-exp: causal SDPA per example, no mask
    else:
        # log-sum-exp, and the packed-row mask that SDPA turns into a float mask in every block
        # (`torch.where` on the boolean mask) and keeps for backward.
        out += s.heads * 4 + st.seq_len * act
    return out


def activations(facts: ModelFacts, st: StepSettings) -> int:
    """Bytes saved for backward by all blocks for one micro-batch, plus the attention mask."""
    s = facts.shape
    tokens = st.micro_batch * st.seq_len
    act = 4 if st.precision == "fp32" else 2
    flowing: list[float] = []  # blocks that backward passes through
    grad_in = facts.embedding_trains
    for layer in facts.layers:
        # Blocks below the first trained one get no backward, so autograd saves nothing there.
        grad_in = grad_in or layer.trains
        if grad_in:
            flowing.append(activation_bytes_per_token(layer, s, st))
    if not flowing:
        return 0
    # With checkpointing each block keeps only its input.
    per_token = len(flowing) * s.hidden * act if st.gradient_checkpointing else sum(flowing)
    # Outside the blocks: embedding output, final norm input and output, RoPE cos/sin.
    per_token += 3 * s.hidden * act + 2 * s.head_dim * 4
    # One seq_len^2 mask per row, shared by every block: boolean (1 byte) for SDPA, additive
    # at the activation dtype for eager attention.
    mask = st.micro_batch * st.seq_len**2 * (1 if st.attn_implementation == "sdpa" else act)
    mask = 0 if st.attn_implementation == "segments" else mask  # segments build no mask
    return int(tokens * per_token + mask + autocast_weight_casts(facts, st, len(flowing)))


def autocast_weight_casts(facts: ModelFacts, st: StepSettings, flowing_blocks: int) -> int:
    """Under autocast every linear casts its weight to bf16/fp16, and backward keeps that copy
    (it needs the weight for the input's gradient): the blocks backward passes through and the
    output head. A 4-bit weight is dequantised again in backward instead; with checkpointing a
    block's copies live only while it is recomputed."""
    if st.precision == "fp32" or st.weight_quant is not None or st.gradient_checkpointing:
        return 0
    s = facts.shape
    # Frozen weights stored in the autocast dtype (`methods.frozen`) are kept as they are.
    cast_linear = facts.linear_params - facts.frozen_linear_params
    head = 0 if facts.frozen_head_params else s.vocab * s.hidden
    # 2 bytes per weight (bf16/fp16): the blocks' linears pro rata, and the output head.
    return 2 * (cast_linear * flowing_blocks // s.layers + head)


def recompute_bytes(facts: ModelFacts, st: StepSettings) -> int:
    """With gradient checkpointing: one block's tensors, recomputed during backward (after the
    loss's transient is gone); 0 without."""
    if not st.gradient_checkpointing:
        return 0
    grad_in = facts.embedding_trains
    largest = 0.0
    for layer in facts.layers:
        grad_in = grad_in or layer.trains
        if grad_in:
            largest = max(largest, activation_bytes_per_token(layer, facts.shape, st))
    return int(st.micro_batch * st.seq_len * largest)


def loss_bytes(facts: ModelFacts, st: StepSettings) -> int:
    """Transient of the vocabulary projection and cross-entropy at the start of backward."""
    s = facts.shape
    per_row = st.supervised_per_row if st.supervised_per_row is not None else st.seq_len
    # Only supervised positions reach the vocabulary projection (`token_loss_sum`).
    n = st.micro_batch * min(per_row, st.seq_len)
    # fp32: log-softmax output + incoming + outgoing gradient; autocast adds the low-precision
    # logits' gradient.
    per = 12 if st.precision == "fp32" else 14
    if st.kl:
        per += 12  # base logits and their log-softmax, and the model's second log-softmax
    # A trained head adds its fp32 gradient, accumulated during the loss's backward.
    head = facts.shape.vocab * s.hidden * 4 if facts.head_trains else 0
    return int(n * s.vocab * per + n * s.hidden * 4 + head)


def weight_bytes(facts: ModelFacts, st: StepSettings, weight_itemsize: int) -> int:
    """Weights at their dtype while training: under autocast the frozen linears are stored in
    its 2-byte dtype (`methods.frozen`); with 4-bit quantisation the blocks' linears shrink."""
    low = 0 if st.precision == "fp32" else max(weight_itemsize - 2, 0)
    stored = (0 if st.weight_quant else facts.frozen_linear_params) + facts.frozen_head_params
    return loaded_weight_bytes(facts, st, weight_itemsize) - low * stored


def loaded_weight_bytes(facts: ModelFacts, st: StepSettings, weight_itemsize: int) -> int:
    """Weights as loaded (model.dtype; 4-bit blocks' linears with quantisation)."""
    if st.weight_quant is None:
        return facts.weight_bytes
    if st.weight_quant not in QUANT_BYTES:
        raise ValueError(f"unknown weight quantisation {st.weight_quant!r}; known: {QUANT_BYTES}")
    # Only the blocks' linears are quantised; embeddings, norms and the head keep their dtype.
    dense = facts.weight_bytes - facts.linear_params * weight_itemsize
    return int(dense + facts.linear_params * QUANT_BYTES[st.weight_quant])


def optimizer_bytes(facts: ModelFacts, optimizer: str) -> int:
    """AdamW's two moments per trainable parameter, at the optimizer's state precision."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATE_BYTES)}")
    per = OPTIMIZER_STATE_BYTES[optimizer]
    return 2 * facts.trainable_bytes if per is None else int(per * facts.trainable_params)


def load_bytes(facts: ModelFacts, st: StepSettings, weight_itemsize: int, weights: int) -> int:
    """Peak of loading the checkpoint (models/loading.py), runtime included; 0 when it is not
    modelled (unknown checkpoint size, or CUDA)."""
    # On CUDA the files are read into host memory, not the device memory the budget is of.
    if st.checkpoint_bytes <= 0 or st.device == "cuda":
        return 0
    overhead = RUNTIME_OVERHEAD.get(st.device, RUNTIME_OVERHEAD["cpu"])
    itemsize = weight_itemsize if st.checkpoint_itemsize is None else st.checkpoint_itemsize
    if st.checkpoint_streamed:
        # Read tensor by tensor (local safetensors, `models.weight_files`): the weights plus the
        # tensor in flight, read at the files' dtype and converted (or quantised) to the run's;
        # a MoE checkpoint's experts likewise, one by one, then stacked. So the largest tensor
        # once at each dtype. (A 6.9B QLoRA load of a 13 GB bf16 checkpoint: 5.99 GiB measured,
        # 8.3 predicted; memory-mapped it peaked at 18.93 GiB.)
        return overhead + weights + facts.largest_tensor * (weight_itemsize + itemsize)
    # Memory-mapped (GGUF, .bin, remote code): every page read stays resident while mapped.
    if st.weight_quant is None and itemsize == weight_itemsize:
        return overhead + max(weights, st.checkpoint_bytes)  # the weights are the mapped pages
    # Converted or quantised: a second copy beside the mapped pages until loading ends.
    return overhead + weights + st.checkpoint_bytes


def short_attention_scores(s: ModelShape, st: StepSettings, longest: int) -> int:
    """The forward transient of a short bf16 segment on CPU (`models.short_attention`): its
    scores in fp32 and the probabilities in bf16, one segment at a time, of at most `longest`
    (and `SHORT_SEGMENT`) tokens."""
    if st.attn_implementation != "segments" or st.precision != "bf16" or st.device != "cpu":
        return 0
    n = min(longest, SHORT_SEGMENT)
    return s.heads * n * n * (4 + 2)


def no_grad_forward_bytes(facts: ModelFacts, st: StepSettings, rows: int) -> int:
    """Peak transient of one forward without grad over `rows` rows (the reference's log-probs,
    `models.loss.reference_token_logps`): the larger of a block's and the output projection's.

    Against a live-tensor count (tests/unit/memory/test_plan_preference.py) it was 0.93x-1.06x
    on a 2-block and a 4-block Llama, fp32 and bf16. Nothing is kept for backward, so a block
    holds the residual stream (its input, the attention sum, the normed input, the embeddings;
    fp32 under autocast, as the weights are) and the MLP's gate, up and their product at once;
    the projection holds two fp32 chunks of logits (and the low-precision one under autocast)
    next to the supervised hidden states.
    """
    s = facts.shape
    act = 4 if st.precision == "fp32" else 2
    tokens = rows * st.seq_len
    per_token = 4 * s.hidden * 4 + 2 * s.head_dim * 4  # + RoPE
    per_token += 0 if st.precision == "fp32" else s.hidden * act  # the input cast for a linear
    mlp = tokens * 3 * s.intermediate * act
    # sdpa's boolean mask and the float copy it makes of it; segments build none.
    mask = 0 if st.attn_implementation == "segments" else rows * st.seq_len**2 * (1 + act)
    # The short segments' scores live during attention, the MLP's tensors after it. Only a
    # preference objective's reference runs this forward: its rows hold two sequences of up to
    # half the row each (`memory.inputs` doubles the row for paired data).
    # Under autocast, attention holds q, k and v cast once per layer (`models.attention`) and
    # the kernel's output and inputs beside them (counted on a tiny Llama: 2q + 4kv elements
    # per token at the peak of a short segment's scores).
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = tokens * (q + 2 * kv) * 4 if st.precision == "fp32" else tokens * (2 * q + 4 * kv) * act
    phase = max(mlp, attn + short_attention_scores(s, st, st.seq_len // 2))
    per_row = st.supervised_per_row if st.supervised_per_row is not None else st.seq_len
    n = rows * min(per_row, st.seq_len)
    chunk = min(n, CHUNK)  # the output projection runs this many positions at a time
    head = chunk * s.vocab * (8 if st.precision == "fp32" else 10) + n * s.hidden * 4
    return int(max(tokens * per_token + phase + mask, head))


def estimate(facts: ModelFacts, st: StepSettings, weight_itemsize: int = 4) -> Breakdown:
    """Predict the peak memory of a training step with settings `st`, and of loading."""
    weights = weight_bytes(facts, st, weight_itemsize)
    loaded = loaded_weight_bytes(facts, st, weight_itemsize)  # before the frozen ones are cast
    overhead = RUNTIME_OVERHEAD.get(st.device, RUNTIME_OVERHEAD["cpu"])
    precomputed = st.reference == "precomputed"
    rows = st.reference_rows
    return Breakdown(
        overhead=overhead,
        weights=weights,
        gradients=facts.trainable_bytes,
        optimizer=optimizer_bytes(facts, st.optimizer),
        activations=activations(facts, st),
        loss=loss_bytes(facts, st),
        recompute=recompute_bytes(facts, st),
        step_temporaries=step_temporaries(facts, st.device),
        load=load_bytes(facts, st, weight_itemsize, loaded),
        reference=no_grad_forward_bytes(facts, st, st.micro_batch)
        if st.reference in ("forward", "live")
        else 0,
        reference_pass=(
            overhead + weights + no_grad_forward_bytes(facts, st, rows) if precomputed else 0
        ),
        # `objectives.batch.with_live_reference` deep-copies the model: every weight again.
        reference_copy=weights if st.reference == "live" else 0,
        margin=fit_margin(st.device, st.allocator, st.weight_quant is not None),
    )


def step_temporaries(facts: ModelFacts, device: str) -> int:
    """AdamW's scratch during `optimizer.step`."""
    if device == "cuda":
        # The default foreach implementation takes the square root of every second moment at
        # once: one copy of all trainable tensors (not measured: no GPU was available).
        return facts.trainable_bytes
    # On CPU torch runs it one tensor at a time: two temporaries of the largest parameter.
    itemsize = facts.trainable_bytes / max(1, facts.trainable_params)
    return int(2 * facts.largest_trainable * itemsize)
