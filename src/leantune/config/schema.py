"""The run configuration's schema: dataclasses hold every section, field, default and doc.

Reading YAML and coercing a value to its field's type are in `config.parse`; loading a file with
overrides in `config.load`; the checks within and across fields in `config.validate`. Checks
that need a registry (a method's, an objective's, a template's, a monitoring backend's) are
their owners', run together by `training.checks` before anything loads.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from leantune.config.dist import DistConfig
from leantune.config.monitor import MonitorConfig
from leantune.config.preference import PreferenceConfig
from leantune.config.roles import (
    BATCH,
    CONTENT,
    FREE,
    OBJECTIVE,
    REASON_KEY,
    SETTING,
    Role,
    UnclassifiedField,
    refused,
    role_of,
)

# Inside the package (leantune/configs), so an installed leantune finds it too.
DEMO_CONFIG = Path(__file__).parent.parent / "configs" / "demo.yaml"
AUTO_RUN_NAME = "auto"
"""run.name that `train` replaces with one derived from the run (training.run_setup)."""
DEFAULT_BATCH_EXAMPLES = 8
"""Examples per optimizer step with micro_batch_size=auto and no train.global_batch_size (HF
Trainer's default batch): the rows that hold that many examples on average (8 unpacked rows;
see training.run_setup.default_global_batch)."""


@dataclass
class RopeScalingConfig:
    type: Literal["linear", "dynamic", "yarn"]
    """linear (position interpolation), dynamic (NTK-aware, grows with the input) or yarn."""
    factor: float
    """Context extension factor (> 1): the new context is factor x the original one."""
    original_max_position_embeddings: int | None = None
    """The context the model was pretrained with (default: the model's max_position_embeddings)."""


@dataclass
class ModelConfig:
    path: str = field(default="smollm2-135m-instruct", metadata=CONTENT)
    """Local HF directory, .gguf file, hub id (offline from the HF cache) or the demo model name."""
    gguf_file: str | None = field(default=None, metadata=CONTENT)
    """GGUF file name inside `path` when `path` is a directory holding one."""
    dtype: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata=SETTING)
    """dtype of the frozen weights."""
    trust_remote_code: bool = field(default=False, metadata=FREE)
    """Allow model code from the model directory (off unless you trust it)."""
    attn_implementation: Literal["auto", "segments", "sdpa", "eager"] = field(
        default="auto", metadata=SETTING
    )
    """Attention kernel for training: segments (causal SDPA per example of a packed row: no
    row x row mask, work only where examples attend), sdpa or eager; auto = segments when rows
    are packed, else sdpa (a resumed run keeps its own). Evaluation and generation use sdpa."""
    rope_scaling: RopeScalingConfig | None = field(default=None, metadata=SETTING)
    """RoPE scaling to train beyond the model's context, e.g. {type: yarn, factor: 4}; keys: type
    (linear | dynamic | yarn), factor, original_max_position_embeddings (optional)."""


@dataclass
class DataConfig:
    train: str | None = field(default=None, metadata=CONTENT)
    """Training JSONL file, or a directory written by `leantune prepare`."""
    eval: str | None = field(default=None, metadata=FREE)
    """Held-out JSONL file (loss, perplexity and, for chat/alpaca, exact match)."""
    format: Literal[
        "alpaca", "chat", "text", "sharegpt", "prompt_completion", "preference", "kto"
    ] = field(default="chat", metadata=SETTING)
    """Record format: alpaca (instruction/input/output), chat (messages), text (text), sharegpt
    (conversations of from/value turns), prompt_completion (TRL's prompt and completion),
    preference (TRL's prompt/chosen/rejected pairs, or chosen/rejected conversations), kto
    (TRL's prompt/completion/label)."""
    max_seq_len: int | Literal["auto"] = field(default="auto", metadata=SETTING)
    """Longest tokenised example (at most 1,048,576); longer ones are reported as bad lines.
    auto = the longest example of data.train, up to the model's context (max_position_embeddings,
    times model.rope_scaling's factor); examples beyond the context are the bad lines then."""
    pack: bool | Literal["auto"] = field(default="auto", metadata=SETTING)
    """Pack several examples into one sequence (they never attend to each other); auto = pack
    unless the method needs one example per row (prefix, ptuning_v2, prompt)."""
    max_bad_fraction: float = field(default=0.05, metadata=FREE)
    """Refuse to start when more than this share of lines is bad (0 = any bad line stops)."""
    system_prompt: str | None = field(default=None, metadata=SETTING)
    """System message added to alpaca records and to chat records that have none."""
    system_message: Literal["auto", "keep", "fold", "drop"] = field(
        default="auto", metadata=SETTING
    )
    """System messages: keep them as the chat template writes them, fold each into the next
    user turn (its text, a blank line, the user's), or drop them. auto = keep where the
    template writes them, fold where it refuses or leaves them out (Gemma 2, Mistral v0.3)."""
    clean: list[Literal["html", "control", "nfkc", "whitespace"]] = field(
        default_factory=list, metadata=SETTING
    )
    """Cleaning rules for every text field before tokenising (none by default: data is used
    as is; `leantune prepare --data` defaults to all four)."""
    dedup: Literal["none", "exact", "near"] = field(default="none", metadata=SETTING)
    """Drop exact duplicates (content hash) or also near duplicates (MinHash/LSH)."""
    near_dup_threshold: float = field(default=0.85, metadata=SETTING)
    """Estimated Jaccard similarity (byte 7-grams) above which a record is a near duplicate."""
    min_tokens: int = field(default=1, metadata=SETTING)
    """Shortest tokenised example; shorter ones are reported as bad lines."""
    truncate: bool = field(default=False, metadata=SETTING)
    """Cut over-long examples to max_seq_len instead of rejecting them (those whose answer is
    cut to nothing are still dropped and counted)."""
    cache_dir: str | None = field(default=None, metadata=FREE)
    """Tokenise-once cache for data.train/data.eval files (default <run dir>/prepared)."""
    engine: Literal["local", "dask"] = field(default="local", metadata=FREE)
    """Where cleaning and tokenisation run: this process, or a Dask cluster."""
    scheduler: str | None = field(default=None, metadata=FREE)
    """Dask scheduler address (tcp://host:8786); unset = a LocalCluster per preparation."""
    partition_mb: float | None = field(default=None, metadata=FREE)
    """Partition size in MB of input (default 4 for local, 64 for dask)."""
    chat_template: str | None = field(default=None, metadata=SETTING)
    """Chat template to render conversations with, replacing the tokenizer's (needed when it has
    none): chatml, zephyr, llama3, or a Jinja file (relative to the config file); it is saved
    with the trained model."""


@dataclass
class MethodConfig:
    name: Literal[
        "full",
        "lora",
        "dora",
        "qlora",
        "ia3",
        "freeze",
        "adapter",
        "prefix",
        "ptuning_v2",
        "prompt",
    ] = field(default="lora", metadata=refused("the checkpoint holds another method's weights"))
    """Fine-tuning method: full, lora, dora (weight-decomposed LoRA), qlora (LoRA on a 4-bit NF4
    base, needs bitsandbytes), ia3 (learned rescaling), freeze (train only the last blocks and/or
    norms), adapter (bottleneck adapters), prefix (prefix tuning), ptuning_v2 (deep prompt tuning
    on every layer) or prompt (prompt tuning)."""
    preset: Literal["default", "seed"] = field(default="default", metadata=SETTING)
    """LoRA preset: default = all linear layers, r=16, alpha=32; seed = the source articles'
    r=8, alpha=32, q_proj/v_proj, dropout 0.1 (explicit r/alpha/... fields still apply)."""
    r: int | None = field(default=None, metadata=SETTING)
    """LoRA rank (preset value when unset)."""
    alpha: int | None = field(default=None, metadata=SETTING)
    """LoRA scaling numerator (preset value when unset)."""
    dropout: float | None = field(default=None, metadata=SETTING)
    """LoRA dropout (preset value when unset)."""
    init: Literal["auto", "default", "loftq", "pissa", "olora"] = field(
        default="auto",
        metadata=refused("the checkpoint's adapters start from another initialisation's base"),
    )
    """How the LoRA adapters start. auto: each method's own (loftq for qlora, measured better on
    two tasks; default for lora and dora). default: B = 0 (the model starts as its base); loftq
    (qlora): A and B fit the 4-bit base's error W - NF4(W) (LoftQ), so the model starts closer
    to the full-precision base. pissa and olora are refused: they do not fit a 4-bit base (use
    loftq) and are not supported yet with lora/dora (the methods guide says why)."""
    loftq_iter: int = field(default=1, metadata=SETTING)
    """method.init=loftq: passes of LoftQ's alternation; 1 (the only value so far) keeps the
    4-bit base that loading made and fits the adapters to its error."""
    last_blocks: int = field(default=2, metadata=SETTING)
    """freeze: how many of the last transformer blocks train."""
    norms: bool = field(default=True, metadata=SETTING)
    """freeze: also train every norm layer."""
    target_modules: list[str] | None = field(default=None, metadata=SETTING)
    """Module (or fused expert weight) names to adapt, or ["all-linear"]: every linear layer and
    routed-expert weight of the blocks, routers left frozen (lora/dora preset value when unset;
    IA3's default: keys, values and the MLP, through qkv_proj where they are fused)."""
    adapter_placement: Literal["houlsby", "pfeiffer"] = field(default="pfeiffer", metadata=SETTING)
    """adapter: houlsby = after attention and MLP of every block; pfeiffer = after the MLP only."""
    adapter_reduction: int = field(default=16, metadata=SETTING)
    """adapter: reduction factor, hidden size / bottleneck size."""
    num_virtual_tokens: int = field(default=20, metadata=SETTING)
    """prefix/ptuning_v2/prompt: number of virtual tokens (prefix length)."""
    prefix_projection: bool | None = field(default=None, metadata=SETTING)
    """prefix/ptuning_v2: train the prefixes through a two-layer MLP (reparameterisation);
    unset = method default (prefix: on, ptuning_v2: off)."""
    prefix_hidden_size: int | None = field(default=None, metadata=SETTING)
    """prefix/ptuning_v2: hidden width of that MLP (unset = the model's key/value width)."""
    prompt_init: Literal["tokens", "random"] | None = field(default=None, metadata=SETTING)
    """prefix/ptuning_v2/prompt: tokens (also when unset) = start the virtual tokens from real
    tokens (those of prompt_init_text, else sampled from the vocabulary): their input embeddings
    (prompt) or the model's own keys/values for them (prefix, ptuning_v2); random = peft's
    N(0, 1)."""
    prompt_init_text: str | None = field(default=None, metadata=SETTING)
    """prefix/ptuning_v2/prompt: the text whose tokens the virtual tokens start from (unset:
    tokens sampled from the vocabulary)."""
    double_quant: bool = field(default=True, metadata=SETTING)
    """qlora: also quantise the 4-bit blocks' scales (saves ~0.37 bit per parameter)."""
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = field(default="auto", metadata=SETTING)
    """qlora: dtype of the 4-bit layers' matmuls; auto = train.precision as resolved (fp32
    unless autocast)."""
    measure_quant_cost: bool = field(default=True, metadata=FREE)
    """qlora: on a fresh run and in `leantune plan`, measure what the 4-bit base costs (the base
    model's held-out loss in model.dtype and in 4-bit, on the first 8 data.eval examples). It
    loads the base twice, which takes minutes for a 7B model; false skips it."""


@dataclass
class TrainConfig:
    max_steps: int | None = field(default=None, metadata=SETTING)
    """Optimizer steps to run; unset = as many as train.epochs take. With train.epochs set too,
    the fewer of the two."""
    epochs: int | None = field(default=None, metadata=SETTING)
    """Passes over the training rows: rows / global batch (rounded up) steps each. Unset = 1,
    unless train.max_steps is set (then max_steps steps, the data repeating as needed)."""
    micro_batch_size: int | Literal["auto"] = field(default="auto", metadata=BATCH)
    """Sequences per forward/backward pass; auto = the largest divisor of the global batch that
    the memory planner predicts fits train.memory_budget (grad_accum then fills the rest; where
    the planner cannot model the run, 4)."""
    global_batch_size: int | None = field(default=None, metadata=BATCH)
    """Rows per optimizer step with micro_batch_size=auto (unset: the rows that hold 8 examples
    on average, as HF Trainer's default batch of 8 does: 8 unpacked rows, fewer packed ones);
    with a fixed micro-batch the global batch is micro_batch_size x grad_accum and this is
    ignored. Data with fewer rows makes every step one pass over all of them."""
    memory_budget: str | None = field(default=None, metadata=FREE)
    """Memory the run may use, e.g. 20GiB. micro_batch_size=auto plans within it (unset: 90% of
    free CUDA memory or available RAM); on CPU a micro-batch whose resident memory goes above it
    counts as out of memory (halve the micro-batch, replay the step; unset: no limit)."""
    grad_accum: int = field(default=1, metadata=BATCH)
    """Micro-batches accumulated per optimizer step."""
    lr: float | None = field(default=None, metadata=SETTING)
    """Peak learning rate (default by method, measured by sweeps: full 1e-4, freeze 1e-3,
    lora/dora/adapter 2e-3, qlora 6e-4, ia3 1e-2, prefix 3e-4, ptuning_v2/prompt 3e-2)."""
    optimizer: Literal["adamw", "adamw_8bit", "adamw_4bit", "paged_adamw_8bit"] = field(
        default="adamw", metadata=refused("another optimizer cannot load this one's state")
    )
    """adamw, or AdamW with 8-bit (bitsandbytes, else torchao) or 4-bit (torchao) state;
    paged_adamw_8bit pages the state to CPU memory under GPU memory pressure (CUDA)."""
    weight_decay: float = field(default=0.01, metadata=SETTING)
    """AdamW weight decay (never applied to biases and norms)."""
    warmup_ratio: float = field(default=0.1, metadata=SETTING)
    """Share of steps spent in linear warmup."""
    min_lr_ratio: float = field(default=0.1, metadata=SETTING)
    """Cosine decay floor as a share of the peak learning rate."""
    max_grad_norm: float = field(default=1.0, metadata=SETTING)
    """Gradient clipping norm (0 disables)."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = field(default="auto", metadata=SETTING)
    """Autocast precision; fp16 uses a GradScaler and needs CUDA. auto: on CUDA bf16 where the
    GPU supports it, else fp16; on CPU bf16 where it runs bf16 matmul clearly faster than fp32
    (measured once per machine), else fp32. A resumed run keeps the precision it started in."""
    seed: int = field(default=42, metadata=SETTING)
    """Seed for initialisation, data order and dropout (0 .. 2**32 - 1)."""
    save_every: int = field(default=50, metadata=FREE)
    """Write a checkpoint every N optimizer steps (0 = only at the end)."""
    keep_last: int = field(default=2, metadata=FREE)
    """Complete checkpoints to keep."""
    objective: Literal["sft", "dpo", "simpo", "orpo", "kto"] = field(
        default="sft", metadata=OBJECTIVE
    )
    """sft: learn the answers (demonstrations); dpo, simpo, orpo: prefer each pair's chosen
    answer over its rejected one; kto: completions labelled desirable or not. Their settings
    are the preference.* fields."""
    reference: Literal["auto", "cached", "live"] = field(default="auto", metadata=OBJECTIVE)
    """Where dpo's reference log-probs come from with method.name=full or freeze. cached (auto
    there): computed once before training and kept with the tokenised data (data.cache_dir, else
    the run's prepared/), keyed by the model's files and the data, so a resume or another run
    reads them; training holds one model. live: a frozen copy of the model, run on every
    micro-batch (twice the weights in memory, no pass before training). Adapter methods (auto
    there) run the model with its adapters off on every micro-batch, with no copy: live is
    the same, cached is refused."""
    kl_coef: float = field(default=0.0, metadata=SETTING)
    """Weight of KL(model || base model) added to the loss (adapter methods only; 0 = off)."""
    gradient_checkpointing: bool | Literal["auto"] = field(default="auto", metadata=FREE)
    """Recompute activations in backward to save memory (about a third more compute). auto: on
    only where the memory planner predicts that not even micro-batch 1 (micro_batch_size=auto)
    or the configured micro-batch fits the memory budget without it, and never for a method
    that does not support it."""
    compile: bool = field(default=False, metadata=FREE)
    """Compile each transformer block's training forward with torch.compile (one process; needs
    a C++ compiler). The first steps pay the compile (tens of seconds on CPU, less with a warm
    cache: about 70 s and 12 s on the demo); later steps ran 7-19% faster there, so it pays on
    long runs (a few hundred steps cold) or repeated ones only."""
    eval_exact_match: bool = field(default=False, metadata=FREE)
    """Measure exact match on the eval set before and after training (chat/alpaca)."""
    eval_every: int = field(default=0, metadata=FREE)
    """Evaluate every N optimizer steps into eval.jsonl (0 = only at the end): eval loss, and for
    chat/alpaca data exact match on the first `eval_every_sample` eval examples."""
    eval_every_sample: int = field(default=20, metadata=FREE)
    """How many eval examples the periodic exact match decodes (0 = loss only)."""
    eval_base: bool = field(default=True, metadata=FREE)
    """With eval_exact_match: also measure the base model before training."""
    eval_limit: int | None = field(default=None, metadata=FREE)
    """Use only the first N eval examples (loss, perplexity and exact match)."""
    eval_batch_size: int = field(default=16, metadata=FREE)
    """Batch size for evaluation and generation."""
    max_new_tokens: int | Literal["auto"] = field(default="auto", metadata=FREE)
    """Most new tokens per exact-match answer during training; auto = the longest data.eval
    reference answer's tokens plus max(16, 25%), the cap `leantune eval` uses (the run log
    says it)."""
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=FREE)
    """Where to train."""


@dataclass
class GuardConfig:
    nonfinite: Literal["skip", "pause", "rollback"] = field(default="skip", metadata=FREE)
    """Action on a NaN/inf loss or gradient: skip the update, pause the run, or roll back."""
    loss_spike: Literal["off", "warn", "skip", "pause", "rollback"] = field(
        default="warn", metadata=FREE
    )
    """Action when the loss jumps far above its recent median."""
    grad_norm: Literal["off", "warn", "skip", "pause", "rollback"] = field(
        default="warn", metadata=FREE
    )
    """Action when the pre-clipping gradient norm jumps far above its recent median."""
    loss_sigmas: float = field(default=6.0, metadata=FREE)
    """Loss spike: robust sigmas (1.4826 x MAD of log loss) above the median that count."""
    loss_min_ratio: float = field(default=3.0, metadata=FREE)
    """Loss spike: never flag a loss below this multiple of the recent median."""
    grad_sigmas: float = field(default=6.0, metadata=FREE)
    """Gradient-norm anomaly: robust sigmas (of log norm) above the median that count."""
    grad_min_ratio: float = field(default=4.0, metadata=FREE)
    """Gradient-norm anomaly: never flag a norm below this multiple of the recent median."""
    window: int = field(default=128, metadata=FREE)
    """Steps of history the robust statistics use."""
    warmup: int = field(default=20, metadata=FREE)
    """Accepted steps before the spike and norm detectors act (non-finite is always on)."""
    max_consecutive_skips: int = field(default=10, metadata=FREE)
    """Stop (with a checkpoint) when this many steps in a row are skipped."""
    lr_factor: float = field(default=0.5, metadata=FREE)
    """Rollback multiplies the learning rate by this (kept on resume)."""
    max_rollbacks: int = field(default=3, metadata=FREE)
    """Stop instead of rolling back once this many rollbacks happened in the run."""


@dataclass
class RunConfig:
    """Where a run lives and whether it continues.

    A run directory records a fingerprint of everything that decides the run's trajectory
    (leantune_run.json): each field's part in it is its `config.roles.Role` (`field_roles`);
    run.resume compares it.
    """

    name: str = field(default="auto", metadata=FREE)
    """Run name (1-100 letters, digits, '.', '_', '-'; no path); the run directory is
    runs/<name> unless run.dir is set. auto = <data file stem>-<method>-<8 hex digits of the
    run's settings and input digests>: another run gets another directory, the same command
    the same one (and resumes)."""
    dir: str | None = field(default=None, metadata=FREE)
    """Run directory (default runs/<name>): new, empty, or a leantune run."""
    resume: Literal["auto", "never", "force"] = field(default="auto", metadata=FREE)
    """auto: continue the newest checkpoint of a run with the same fingerprint, else exit 2
    listing the changed fields; force: continue it with the changes (it says what each means;
    weights that cannot load are still refused); never: start over, moving a run that is in
    the directory aside to <dir>.old-<time>."""
    progress: bool = field(default=True, metadata=FREE)
    """Show a progress bar."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    run: RunConfig = field(default_factory=RunConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    @property
    def run_dir(self) -> Path:
        """The run directory; run.name=auto must have been named first (`train` does it)."""
        if self.run.dir:  # an explicit run.dir wins over the name
            return Path(self.run.dir)
        if self.run.name == AUTO_RUN_NAME:
            raise RuntimeError(
                "run.name=auto: the run is named when it starts (training.run_setup.named_run)"
            )
        return Path("runs") / self.run.name


def field_docs() -> dict[str, str]:
    """`section.field` -> its one-line docstring, for `leantune validate --help-fields`."""
    docs: dict[str, str] = {}
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        # The docs are attribute docstrings (a string after the field), which Python does not
        # keep at run time: read them from the source.
        tree = ast.parse(inspect.getsource(cls))  # type: ignore[arg-type]
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
            ):
                # One line: the source wraps the text at 100 columns.
                docs[f"{section.name}.{node.target.id}"] = " ".join(str(nxt.value.value).split())
    return docs


def field_roles(config: type = Config) -> dict[str, Role]:
    """`section.field` -> its fingerprint `Role`, for every field of every section of `config`.

    Raises:
        UnclassifiedField: a field has no role in its metadata (named, with the fix).
    """
    roles: dict[str, Role] = {}
    missing: list[str] = []
    for section in dataclasses.fields(config):
        for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            key = f"{section.name}.{f.name}"
            role = role_of(f)
            if role is None:  # collected, so that one error names every unclassified field
                missing.append(key)
            else:
                roles[key] = role
    if missing:
        raise UnclassifiedField(
            f"config fields without a fingerprint role: {', '.join(missing)}; declare each "
            "with field(default=..., metadata=<a config.roles constant>) (config/roles.py says "
            "what each role means to a resume)"
        )
    return roles


def refused_reasons(config: type = Config) -> dict[str, str]:
    """`section.field` -> why `run.resume=force` refuses its change, for the `Role.REFUSED`
    fields of `config`."""
    reasons: dict[str, str] = {}
    for section in dataclasses.fields(config):
        for f in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            if role_of(f) is Role.REFUSED:
                reasons[f"{section.name}.{f.name}"] = str(f.metadata[REASON_KEY])
    return reasons
