"""Shared test helpers: a tokenizer trained in-process, tiny Llama/Qwen2 models built from
config, the chat rows and config most training tests use, an in-process CLI runner and
`leantune train` in its own process.

Test files import them with `from support import ...` (never from one another); the fixtures
built on them are in conftest.py. A module, not the conftest, because pytest imports each conftest
outside a package under the one name `conftest`: tests/distributed/conftest.py would stand in for
tests/conftest.py in a `from conftest import`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from leantune.cli import app
from leantune.config import Config
from leantune.core import allocator
from leantune.data.dataset import PreparedData, prepared_data
from leantune.data.prepare.records import PrepareSettings
from leantune.monitor.dashboard import make_server
from leantune.monitor.dashboard.server import DashboardServer
from leantune.monitor.metrics import read_metrics
from leantune.training.checks import load_config

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    'Answer in JSON: {"intent": "refund", "order_id": "A-1234", "priority": "high"}',
    "user assistant system: please help me with my order, it has not arrived yet.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ' \" ( ) [ ] { } < > = + - * /",
    "Instruction: translate to French. Input: cat. Output: chat.",
]


def train_bpe(corpus: list[str], special_tokens: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained in-process on `corpus` x 20, special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    return tok


def build_tiny_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (vocab 384) with ChatML special tokens and save it."""
    tok = train_bpe(_CORPUS, SPECIAL_TOKENS, 384)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _tiny_dims(vocab_size: int) -> dict[str, int | None]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def tiny_llama_config(vocab_size: int = 384) -> LlamaConfig:
    """2-layer Llama with GQA and tied embeddings."""
    return LlamaConfig(**_tiny_dims(vocab_size), tie_word_embeddings=True)


def tiny_qwen2_config(vocab_size: int = 384) -> Qwen2Config:
    """2-layer Qwen2 (attention biases) with a separate output projection."""
    return Qwen2Config(**_tiny_dims(vocab_size), tie_word_embeddings=False)


def chain_model(tokenizer: PreTrainedTokenizerFast, chain: dict[int, int]) -> Qwen2ForCausalLM:
    """A Qwen2 whose next token depends only on the current one, following `chain`.

    Attention and MLP outputs are zeroed, so the final hidden state is the (normalised) input
    embedding; token `t` in `chain` embeds to its own basis vector, which the lm_head maps to
    `chain[t]`; every other token embeds to a shared vector mapped to "z".
    """
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config())
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        embed.zero_()
        head.zero_()
        embed[:, hidden - 1] = 1.0
        head[tokenizer.convert_tokens_to_ids("z"), hidden - 1] = 10.0
        for direction, (token, next_token) in enumerate(chain.items()):
            embed[token] = 0.0
            embed[token, direction] = 1.0
            head[next_token, direction] = 10.0
    return model.eval()


def save_tiny_model(
    out_dir: Path,
    arch: str,
    tokenizer_dir: Path,
    seed: int = 0,
    initializer_range: float | None = None,
) -> Path:
    """Build a 2-layer model from config with fixed init and save it with the tiny tokenizer.

    A larger `initializer_range` than the default 0.02 gives logits far from 0, so a broken
    export moves them measurably."""
    torch.manual_seed(seed)
    config = tiny_llama_config() if arch == "llama" else tiny_qwen2_config()
    if initializer_range is not None:
        config.initializer_range = initializer_range
    if arch == "llama":
        model: torch.nn.Module = LlamaForCausalLM(config)
    else:
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def write_jsonl(path: Path, rows: list[object]) -> Path:
    """Write rows as JSON lines (strings are written verbatim, to make bad lines)."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row, ensure_ascii=False))
            f.write("\n")
    return path


def prepare_rows(
    path: Path,
    fmt: str,
    tokenizer: PreTrainedTokenizerFast,
    max_seq_len: int,
    pack: bool,
    *,
    system_prompt: str | None = None,
    system_message: str = "auto",
    max_bad_fraction: float = 0.0,
    limit: int | None = None,
) -> PreparedData:
    """A data file's rows through `prepared_data` (the one data path), uncleaned, without a
    cache directory: what `eval` and `plan` read."""
    return prepared_data(
        path,
        settings=PrepareSettings(fmt, max_seq_len, pack, system_prompt, system_message),
        tokenizer=tokenizer,
        max_bad_fraction=max_bad_fraction,
        limit=limit,
    )


def chat_rows(n: int, offset: int = 0) -> list[dict[str, Any]]:
    """`n` short order-status chats (user question, JSON assistant answer), from `offset` on."""
    items = ["lamp", "desk", "phone", "cable", "chair", "mouse", "screen", "bag"]
    rows = []
    for i in range(offset, offset + n):
        item = items[i % len(items)]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Order {i} for a {item}, status?"},
                    {"role": "assistant", "content": json.dumps({"item": item, "id": i})},
                ]
            }
        )
    return rows


# Eight one-word chats ("q i" -> "a i"): the methods' and adapters' round-trip data.
QA_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"q {i}"},
            {"role": "assistant", "content": f"a {i}"},
        ]
    }
    for i in range(8)
]


def plan_config_file(tmp_path: Path, model_dir: Path, train: str) -> Path:
    """A config file of 8 one-word chats (unpacked, 64 tokens) with `train: <train>` (YAML)."""
    rows = [
        {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(8)
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{path: {model_dir}}}\ndata: {{train: {data}, max_seq_len: 64, pack: false}}\n"
        f"train: {train}\n"
    )
    return cfg


def make_config(model_dir: Path, train_file: Path, run_dir: Path, *extra: str) -> Config:
    """A 4-step chat run on a tiny model (micro-batch 2, lr 1e-2, seed 3, no evaluation);
    `extra` overrides come last, so they win."""
    overrides = [
        f"model.path={model_dir}",
        f"data.train={train_file}",
        "data.format=chat",
        "data.max_seq_len=128",
        f"run.dir={run_dir}",
        "run.progress=false",
        "train.max_steps=4",
        "train.micro_batch_size=2",
        "train.lr=1e-2",
        "train.seed=3",
        "data.eval=null",
        "train.eval_exact_match=false",
        *extra,
    ]
    return load_config(None, overrides)


def tiny_train_args(model: Path, data: Path, run_dir: Path | None, *extra: str) -> list[str]:
    """`leantune train` on a tiny model and a chat file: no evaluation, no progress bar,
    micro-batch 2, lr 1e-2. `extra` overrides come last, so they win; no `run.dir` when
    `run_dir` is None (the default runs/<run.name>)."""
    where = [f"run.dir={run_dir}"] if run_dir is not None else []
    return [
        "train",
        f"model.path={model}",
        f"data.train={data}",
        "data.format=chat",
        "data.max_seq_len=128",
        "data.eval=null",
        "train.eval_exact_match=false",
        "run.progress=false",
        "train.micro_batch_size=2",
        "train.lr=1e-2",
        *where,
        *extra,
    ]


@dataclass
class CliResult:
    """What one `leantune` invocation returned and printed."""

    code: int
    out: str
    err: str


def run_cli(args: list[str]) -> CliResult:
    """Run `leantune ARGS` in this process; fails the test on any Python traceback.

    Every user mistake must end in a clear message and an exit code, never a traceback: an
    exception escaping `main` fails here, and so does a traceback printed to either stream.
    """
    from leantune.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    result = CliResult(code, out.getvalue(), err.getvalue())
    assert "Traceback" not in result.out + result.err, result
    return result


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTUNE_")}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **extra}


def _one_process(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "leantune", "train", *args]
    return subprocess.run(command, env=_env(**env), capture_output=True, text=True, timeout=300)


def _ok(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:] + _rank_logs(done)


def _rank_logs(done: subprocess.CompletedProcess[str]) -> str:
    """The tail of each rank's own stderr when torchrun was given --log-dir (a rank that dies
    natively says why only there; PYTHONFAULTHANDLER adds its Python stacks)."""
    dirs = [a.split("=", 1)[1] for a in done.args if str(a).startswith("--log-dir=")]
    logs = sorted(Path(dirs[0]).glob("*/*/*/stderr.log")) if dirs else []
    return "".join(f"\n--- rank {p.parent.name} stderr ---\n{p.read_text()[-4000:]}" for p in logs)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    final = run_dir / "final"
    adapter = final / "adapter_model.safetensors"
    return load_file(adapter if adapter.exists() else final / "model.safetensors")


def _assert_same_run(a: Path, b: Path) -> None:
    """The same loss and gradient-norm curves and final weights, to float error (sums in
    another order). The norms matter: Adam's update does not change when every gradient is
    scaled alike, so only they would show a gradient averaged where it should be summed. Adam
    also divides by the root of tiny second moments, which can magnify a rounding difference
    in a weight whose gradient is near zero up to a fraction of one step (lr 1e-2)."""
    ra, rb = read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], rel=1e-5)
    assert [r["grad_norm"] for r in ra] == pytest.approx([r["grad_norm"] for r in rb], rel=1e-4)
    wa, wb = _final_weights(a), _final_weights(b)
    assert set(wa) == set(wb) and wa
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-3, msg=k)
    # The weights moved: an update that did nothing would also be "equal".
    assert any(not torch.equal(wa[k], torch.zeros_like(wa[k])) for k in wa)


@contextlib.contextmanager
def serving(root: Path) -> Iterator[DashboardServer]:
    """`leantune dashboard` over `root` on a thread, for the length of the block."""
    server = make_server(root)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# ---------------------------------------------------------------------------------------------
# Preference objectives: pairs, unpaired (KTO) examples and a `leantune train` on them


def preference_pairs(n: int) -> list[dict[str, str]]:
    """`n` standard-form pairs: a sum, its right answer (chosen) and a wrong one (rejected)."""
    return [
        {"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.", "rejected": f"Maybe {i}."}
        for i in range(n)
    ]


PAIRS = preference_pairs(8)
UNPAIRED = [
    {"prompt": f"What is {i} plus {i}?", "completion": f"It is {2 * i}.", "label": True}
    for i in range(4)
] + [
    {"prompt": f"What is {i} plus {i}?", "completion": f"Maybe {i}.", "label": False}
    for i in range(4)
]
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def pref_args(model: Path, data: Path, run: Path, objective: str, *extra: str) -> list[str]:
    """`leantune train` with train.objective: data.format=chat (tiny_train_args's, the
    default) is read as the objective's format (preference, kto)."""
    return tiny_train_args(
        model,
        data,
        run,
        f"train.objective={objective}",
        "data.max_seq_len=auto",
        "train.precision=fp32",
        "method.dropout=0",
        *extra,
    )


class _Executed(Exception):
    """Raised by the fake execve of `reexecuted_environment`: the command stops there."""


def reexecuted_environment(
    monkeypatch: pytest.MonkeyPatch, cleared: tuple[str, ...], contended: bool
) -> dict[str, str]:
    """The environment the `leantune` command re-executes itself with (the tcmalloc preload's
    execve, faked), with the variables `cleared` unset first and the machine `contended` or not."""
    for name in (*cleared, allocator.MARK, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setattr(allocator, "preload_for", lambda environ: Path("/lib/libtcmalloc.so.4"))
    seen: dict[str, str] = {}

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        seen.update(env)
        raise _Executed

    monkeypatch.setattr(allocator.os, "execve", execve)
    monkeypatch.setattr(app, "machine_contended", lambda: contended)
    with pytest.raises(_Executed):
        app.run(argparse.Namespace(own_process=True, command="train", check=None, run="x:y"))
    return seen
