"""A prepared directory is only ever read with the tokenizer (and chat template) that made it.

Its token ids mean text only to that tokenizer: trained on by a model with another vocabulary
of the same size they silently teach the wrong text, and with a smaller one they index past the
embedding. `leantune prepare` records the tokenizer's digest in the directory and every reader
(train's data.train and data.eval, plan) refuses another tokenizer with exit 2; token ids past
the model's embedding are refused before training as a second line of defence.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_zoo import PLANT_CORPUS, save_family_model
from support import (
    SPECIAL_TOKENS,
    chat_rows,
    run_cli,
    save_tiny_model,
    tiny_llama_config,
    tiny_train_args,
    train_bpe,
    write_jsonl,
)
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from leantune.data.dataset import PreparedData, check_token_range, prepared_data
from leantune.data.prepare.provenance import (
    TokenizerMismatch,
    tokenizer_digest,
    tokenizer_fingerprint,
)
from leantune.data.prepare.records import PrepareSettings
from leantune.data.prepare.shards import read_examples
from leantune.data.tokenize import Example
from leantune.errors import UserError
from leantune.models.loading import load_tokenizer, resolve_model


def _max_id(prepared: Path) -> int:
    return max(max(ids) for ids in read_examples(prepared).column("input_ids").to_pylist())


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The tiny tokenizer's recipe (same special tokens, same 384 vocabulary size, same chat
    template) trained on other text: other merges, so other ids for the same words."""
    tok = train_bpe(PLANT_CORPUS, SPECIAL_TOKENS, 384)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).chat_template
    out = tmp_path_factory.mktemp("other_tokenizer")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory: pytest.TempPathFactory, other_tokenizer_dir: Path) -> Path:
    """A tiny Llama of the same vocabulary size as `tiny_llama_dir`, with the other tokenizer."""
    out = tmp_path_factory.mktemp("other_llama")
    return save_tiny_model(out, "llama", other_tokenizer_dir)


@pytest.fixture(scope="module")
def qwen_family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zoo Qwen2.5 model: a larger vocabulary (and other ids) than the tiny tokenizer's."""
    return save_family_model(tmp_path_factory.mktemp("qwen25"), "qwen2.5")


def _prepare(tmp_path: Path, model: Path, *extra: str, fmt: str = "chat") -> Path:
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(16))
    if fmt == "text":
        data = write_jsonl(tmp_path / "train.jsonl", [{"text": f"line {i}"} for i in range(16)])
    out = tmp_path / "train.prepared"
    args = ["prepare", "--data", str(data), "--format", fmt, "--model", str(model)]
    done = run_cli([*args, "--out", str(out), "--max-seq-len", "128", *extra])
    assert done.code == 0, done
    return out


def _train(model: Path, data: Path, run_dir: Path, *extra: str, fmt: str = "chat"):
    args = tiny_train_args(model, data, run_dir, "train.max_steps=1", f"data.format={fmt}", *extra)
    return run_cli(args)


def test_same_vocabulary_size_other_tokenizer_is_refused_naming_both(
    tmp_path: Path, tiny_llama_dir: Path, other_llama_dir: Path
) -> None:
    tiny = load_tokenizer(resolve_model(str(tiny_llama_dir)))
    other = load_tokenizer(resolve_model(str(other_llama_dir)))
    assert len(tiny) == len(other) == 384  # the sizes match: nothing else would catch it
    assert tiny("Order 3 for a lamp")["input_ids"] != other("Order 3 for a lamp")["input_ids"]
    prepared = _prepare(tmp_path, tiny_llama_dir)
    done = _train(other_llama_dir, prepared, tmp_path / "run")
    assert done.code == 2, done
    err = done.err
    assert str(prepared) in err and str(tiny_llama_dir) in err and str(other_llama_dir) in err
    assert tokenizer_digest(tiny).ids[:12] in err and tokenizer_digest(other).ids[:12] in err
    assert "leantune prepare" in err and "model.path" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


def test_smaller_vocabulary_is_refused_without_a_traceback(
    tmp_path: Path, tiny_llama_dir: Path, qwen_family_dir: Path
) -> None:
    prepared = _prepare(tmp_path, qwen_family_dir)
    assert _max_id(prepared) >= 384  # past the tiny Llama's embedding: an IndexError before
    done = _train(tiny_llama_dir, prepared, tmp_path / "run")  # run_cli fails on a traceback
    assert done.code == 2, done
    assert str(prepared) in done.err and str(qwen_family_dir) in done.err
    assert str(tiny_llama_dir) in done.err


def test_the_same_tokenizer_in_another_model_directory_trains(
    tmp_path: Path, tiny_llama_dir: Path, tokenizer_dir: Path
) -> None:
    """The digest is of the tokenizer's contents, not of its path: another Llama (other weights,
    the same tokenizer files) trains on data prepared with the tiny Llama."""
    other = save_tiny_model(tmp_path / "llama_seed1", "llama", tokenizer_dir, seed=1)
    prepared = _prepare(tmp_path, tiny_llama_dir)
    done = _train(other, prepared, tmp_path / "run")
    assert done.code == 0, done
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(m)["step"] for m in metrics] == [1]


def test_the_same_files_read_as_another_tokenizer_class_are_a_mismatch(
    tmp_path: Path, tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    """transformers reads the tiny tokenizer's files in a Qwen2 model directory as a
    Qwen2Tokenizer, with Qwen2's pre-tokenizer (digits split apart): other ids for the same
    text, so the files being equal is not enough."""
    llama = load_tokenizer(resolve_model(str(tiny_llama_dir)))
    qwen2 = load_tokenizer(resolve_model(str(tiny_qwen2_dir)))
    assert llama("Order 12")["input_ids"] != qwen2("Order 12")["input_ids"]
    prepared = _prepare(tmp_path, tiny_llama_dir)
    done = _train(tiny_qwen2_dir, prepared, tmp_path / "run")
    assert done.code == 2, done
    assert "the tokenizers differ" in done.err


@pytest.mark.parametrize(
    ("prepare_with", "train_with"),
    [((), ("data.chat_template=zephyr",)), (("--chat-template", "zephyr"), ())],
)
def test_another_chat_template_alone_is_a_mismatch(
    tmp_path: Path, tiny_llama_dir: Path, prepare_with: tuple[str, ...], train_with: tuple[str, ...]
) -> None:
    prepared = _prepare(tmp_path, tiny_llama_dir, *prepare_with)
    done = _train(tiny_llama_dir, prepared, tmp_path / "run", *train_with)
    assert done.code == 2, done
    assert "the chat templates differ" in done.err and "data.chat_template" in done.err
    assert str(prepared) in done.err


def test_text_data_ignores_the_chat_template(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Plain text is never rendered through a template: another one is no mismatch there."""
    prepared = _prepare(tmp_path, tiny_llama_dir, fmt="text")
    zephyr = "data.chat_template=zephyr"
    done = _train(tiny_llama_dir, prepared, tmp_path / "run", zephyr, fmt="text")
    assert done.code == 0, done


def test_a_directory_prepared_before_digests_were_recorded_is_refused(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    prepared = _prepare(tmp_path, tiny_llama_dir)
    report = json.loads((prepared / "prepare_report.json").read_text())
    del report["tokenizer_digest"]
    (prepared / "prepare_report.json").write_text(json.dumps(report))
    done = _train(tiny_llama_dir, prepared, tmp_path / "run")
    assert done.code == 2, done
    assert "prepare it again" in done.err and str(prepared) in done.err


def test_data_eval_prepared_with_another_tokenizer_is_refused(
    tmp_path: Path, tiny_llama_dir: Path, other_llama_dir: Path
) -> None:
    prepared = _prepare(tmp_path, other_llama_dir)
    train = write_jsonl(tmp_path / "t.jsonl", chat_rows(8))
    done = _train(tiny_llama_dir, train, tmp_path / "run", f"data.eval={prepared}")
    assert done.code == 2, done
    assert str(prepared) in done.err and str(other_llama_dir) in done.err


def test_plan_refuses_a_prepared_directory_of_another_tokenizer(
    tmp_path: Path, tiny_llama_dir: Path, other_llama_dir: Path
) -> None:
    prepared = _prepare(tmp_path, tiny_llama_dir)
    args = [f"model.path={other_llama_dir}", f"data.train={prepared}", "data.format=chat"]
    done = run_cli(["plan", *args, "data.max_seq_len=128", "--budget", "64GiB"])
    assert done.code == 2, done
    assert str(prepared) in done.err and str(other_llama_dir) in done.err


def test_library_reader_refuses_another_tokenizer(
    tmp_path: Path, tiny_llama_dir: Path, other_llama_dir: Path
) -> None:
    prepared = _prepare(tmp_path, tiny_llama_dir)
    other = load_tokenizer(resolve_model(str(other_llama_dir)))
    settings = PrepareSettings("chat", 128)
    with pytest.raises(TokenizerMismatch) as caught:
        prepared_data(prepared, settings=settings, tokenizer=other)
    assert isinstance(caught.value, UserError)
    tiny = load_tokenizer(resolve_model(str(tiny_llama_dir)))
    assert len(prepared_data(prepared, settings=settings, tokenizer=tiny).examples) == 16


def test_the_digest_ignores_call_time_padding_and_truncation(tiny_llama_dir: Path) -> None:
    """Padding and truncation are settings the backend keeps from its last call: a tokenizer
    that padded a batch is the same tokenizer (and the cache key must not change with it)."""
    tok = load_tokenizer(resolve_model(str(tiny_llama_dir)))
    before = tokenizer_fingerprint(tok)
    tok(["a b", "c"], padding=True)
    assert tok.backend_tokenizer.padding is not None  # the state the digest must leave out
    assert tokenizer_fingerprint(tok) == before
    tok("a b c", truncation=True, max_length=2)
    assert tok.backend_tokenizer.truncation is not None
    assert tokenizer_fingerprint(tok) == before
    assert tok.backend_tokenizer.truncation is not None  # the caller's tokenizer is unchanged
    tok.chat_template = "{{ messages }}"
    assert tokenizer_fingerprint(tok) != before


# --- the second line of defence: ids past the embedding never reach it -----------------------


def test_token_ids_past_the_embedding_are_refused(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A model whose embedding is smaller than its tokenizer (a misconfigured checkpoint):
    the data is tokenised with its own tokenizer, so only the range check can catch it, in
    train and in eval."""
    model_dir = tmp_path / "narrow"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab_size=300)).save_pretrained(model_dir)
    PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(model_dir)
    train = write_jsonl(tmp_path / "t.jsonl", chat_rows(16))
    done = _train(model_dir, train, tmp_path / "run")
    assert done.code == 2, done
    assert "300 rows" in done.err and f"{train}:1: token id" in done.err
    done = run_cli(["eval", "--model", str(model_dir), "--data", str(train)])
    assert done.code == 2, done
    assert "300 rows" in done.err and f"{train}:1: token id" in done.err


def test_check_token_range_names_the_first_record_out_of_range() -> None:
    from leantune.data.formats import Record

    records = [Record("d.jsonl", n, text="x") for n in (1, 2, 3)]
    examples = [Example([1, 2], [2, -100]), Example([3, 9], [9, -100]), Example([5], [-100])]
    data = PreparedData(rows=[], examples=examples, records=records)
    check_token_range(data, 10, "d.jsonl")  # every id below 10
    with pytest.raises(UserError, match=r"d\.jsonl:2.*token id 9.*9 rows"):
        check_token_range(data, 9, "d.jsonl")
    bad = PreparedData(rows=[], examples=[Example([-1], [-100])], records=records[:1])
    with pytest.raises(UserError, match="token id -1"):
        check_token_range(bad, 9, "d.jsonl")
