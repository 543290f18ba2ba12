"""train.max_new_tokens=auto (the default): training's exact match caps each answer where
`leantune eval` does, at the longest data.eval reference plus its margin, and says so; an
integer still wins."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import chat_rows, make_config, write_jsonl
from transformers import PreTrainedTokenizerFast

import leantune.training.evaluation as evaluation
from leantune.eval.exact_match import answer_token_cap, longest_answer_tokens
from leantune.training.recipe import train


@pytest.mark.parametrize("setting", [None, 7])
def test_auto_caps_at_the_eval_references_and_an_integer_wins(
    tiny_llama_dir: Path,
    tokenizer: PreTrainedTokenizerFast,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    setting: int | None,
) -> None:
    held_out = chat_rows(3, offset=50)
    # One long reference: the cap follows the longest one, not the first or a fixed number.
    held_out[1]["messages"][-1]["content"] = " ".join(["lamp desk phone"] * 4)
    references = [r["messages"][-1]["content"] for r in held_out]
    longest = longest_answer_tokens(tokenizer, references)
    auto = answer_token_cap(longest)
    assert longest > 30 and auto not in (128, 7)  # told apart from the old default and 7
    caps: list[int | None] = []
    real = evaluation.evaluate_exact_match

    def recorded(*args: object, **kwargs: object) -> tuple[float, list[str]]:
        caps.append(args[4])  # type: ignore[arg-type]  # max_new_tokens, as exact_match passes it
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(evaluation, "evaluate_exact_match", recorded)
    train_file = write_jsonl(tmp_path / "train.jsonl", chat_rows(4))
    eval_file = write_jsonl(tmp_path / "eval.jsonl", held_out)
    extra = [f"data.eval={eval_file}", "train.max_steps=1", "train.eval_exact_match=true"]
    extra += [] if setting is None else [f"train.max_new_tokens={setting}"]
    cfg = make_config(tiny_llama_dir, train_file, tmp_path / "run", *extra)
    assert cfg.train.max_new_tokens == ("auto" if setting is None else setting)
    lines: list[str] = []
    train(cfg, log=lines.append)
    said = [x for x in lines if "exact match: answers capped at" in x]
    if setting is None:
        # Base and final exact match, both at the cap, which the log says once.
        assert caps == [auto, auto]
        assert said == [
            f"exact match: answers capped at {auto} new tokens (longest reference {longest} + "
            f"{auto - longest}); train.max_new_tokens sets another cap"
        ]
    else:
        assert caps == [setting, setting] and said == []
