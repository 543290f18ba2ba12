"""Training's exact match shows eval's progress line (run.progress, on a terminal) and clears it."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import chat_rows
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from leantune.data.formats import Record
from leantune.training.evaluation import EvalSettings, exact_match


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("progress", [True, False])
def test_exact_match_in_a_run_draws_its_progress_line(
    tiny_qwen2_dir: Path,
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
    progress: bool,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    records = [
        Record("held_out.jsonl", i + 1, tuple(r["messages"])) for i, r in enumerate(chat_rows(3))
    ]
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    settings = EvalSettings("fp32", 2, 3, progress=progress)
    score = exact_match(model, tokenizer, records, settings, batch_size=2)
    assert score == 0.0  # a random model
    if progress:
        # Drawn with its count, then cleared (leave=False): the run's own lines follow.
        assert "exact match: 0/3 examples" in screen.getvalue()
        assert screen.getvalue().endswith("\r")
    else:
        assert screen.getvalue() == ""
