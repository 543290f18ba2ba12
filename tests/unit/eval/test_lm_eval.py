"""lm-evaluation-harness on a tiny local multiple-choice task: the harness's accuracy and
per-choice log-likelihoods equal our own computation with the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

pytest.importorskip("lm_eval")

from leantune.cli.app import main
from leantune.eval.harness import run_lm_eval, summarize

DOCS = [
    {
        "question": "The quick brown fox jumps over the",
        "choices": ["lazy dog.", "order A-1234."],
        "answer": 0,
    },
    {"question": "Hello world! How are you", "choices": ["today?", "refund"], "answer": 0},
    {
        "question": "Instruction: translate to French. Input: cat. Output:",
        "choices": ["chat.", "dog"],
        "answer": 0,
    },
    {"question": "Numbers 0 1 2 3", "choices": ["4 5 6", "fox fox"], "answer": 1},
    {"question": "please help me with my", "choices": ["order", "lazy"], "answer": 0},
]

TASK_YAML = """task: leantune_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tasks")
    data = write_jsonl(d / "tiny_mc.jsonl", DOCS)
    (d / "tiny_mc.yaml").write_text(TASK_YAML.format(data=data))
    return d


def _loglikelihood(
    model: torch.nn.Module, tok: PreTrainedTokenizerBase, context: str, continuation: str
) -> float:
    """Sum of log p(continuation tokens | context), splitting tokens as the harness does: the
    continuation is what the whole string's tokens add after the context's tokens."""
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx) :]
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0]
    logp = F.log_softmax(logits.float(), dim=-1)
    start = len(whole) - len(cont)
    return float(sum(logp[start - 1 + i, t] for i, t in enumerate(cont)))


def test_accuracy_equals_our_own_loglikelihood_argmax(tiny_llama_dir: Path, task_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    out = run_lm_eval(
        model,
        tok,
        ["leantune_tiny_mc"],
        include_path=str(task_dir),
        include_defaults=False,
        log_samples=True,
    )
    ours = [
        [_loglikelihood(model, tok, d["question"], " " + c) for c in d["choices"]] for d in DOCS
    ]
    samples = sorted(out["samples"]["leantune_tiny_mc"], key=lambda s: s["doc_id"])
    theirs = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    assert len(theirs) == len(DOCS)
    for a, b in zip(theirs, ours, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    want_acc = sum(
        max(range(2), key=lambda i: ll[i]) == d["answer"] for ll, d in zip(ours, DOCS, strict=True)
    ) / len(DOCS)
    assert summarize(out)["leantune_tiny_mc"]["acc"] == pytest.approx(want_acc)


def test_cli_eval_lm_eval_with_limit(
    tiny_llama_dir: Path, task_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_llama_dir),
            "--lm-eval",
            "leantune_tiny_mc",
            "--lm-eval-limit",
            "2",
            "--lm-eval-include",
            str(task_dir),
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    acc = result["lm_eval"]["leantune_tiny_mc"]["acc"]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hits = [
        max(
            range(2), key=lambda i: _loglikelihood(model, tok, d["question"], " " + d["choices"][i])
        )
        == d["answer"]
        for d in DOCS[:2]
    ]
    assert acc == pytest.approx(sum(hits) / 2)
