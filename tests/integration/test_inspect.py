"""`leantune inspect`: what will be trained, without training.

For every format: the supervised tokens between the markers are exactly the answer (and the
end-of-turn text the model learns to write), the counts are the tokenizer's, the report has the
length histogram, packing, bad lines and the planner's prediction, and nothing is written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from support import run_cli, write_jsonl

from leantune.data.formats import read_records
from leantune.data.preference_dataset import preference_data
from leantune.data.tokenize import encode_record

ANSWER = "hello world"
RECORDS: dict[str, dict[str, Any]] = {
    "chat": {
        "messages": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": ANSWER},
        ]
    },
    "alpaca": {"instruction": "Say hi", "output": ANSWER},
    "sharegpt": {
        "conversations": [
            {"from": "human", "value": "Say hi"},
            {"from": "gpt", "value": ANSWER},
        ]
    },
    "prompt_completion": {
        "prompt": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "Say it in full"},
        ],
        "completion": ANSWER,
    },
}


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def inspect(tmp_path: Path, model: Path, data: Path, fmt: str, *extra: str) -> Any:
    """Run `leantune inspect` in `tmp_path` and check that it wrote nothing."""
    before = files_under(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = run_cli(
            [
                "inspect",
                f"model.path={model}",
                f"data.train={data}",
                f"data.format={fmt}",
                "data.max_seq_len=128",
                "data.eval=null",
                "train.eval_exact_match=false",
                *extra,
            ]
        )
    finally:
        os.chdir(cwd)
    assert files_under(tmp_path) == before, "inspect wrote files"
    return r


@pytest.mark.parametrize("fmt", list(RECORDS))
def test_the_markers_enclose_exactly_the_answer(
    tmp_path: Path, tiny_llama_dir: Path, tokenizer, fmt: str
) -> None:
    rows = [RECORDS[fmt]] * 3 + ['{"broken'] + [RECORDS[fmt]]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    r = inspect(tmp_path, tiny_llama_dir, data, fmt, "data.max_bad_fraction=0.5", "-n", "2")
    assert r.code == 0, r
    out = r.out
    # exactly one supervised span per example shown, holding the answer and its end of turn
    examples = out.split("--- example", 1)[1]  # after the line that explains the markers
    spans = re.findall(r"\[\[(.*?)\]\]", examples, re.S)
    assert spans == [f"{ANSWER}<|im_end|>\n"] * 2, out
    # the counts are the tokenizer's
    records, _ = read_records(data, fmt)
    ex = encode_record(tokenizer, records[0])
    assert (
        f"example 1 of 4 (d.jsonl:1): {len(ex.input_ids)} tokens, {ex.num_supervised} supervised"
        in out
    )
    assert "example 2 of 4 (d.jsonl:2)" in out and "example 3 of" not in out
    n = len(ex.input_ids)
    assert (
        f"lengths: 4 examples, {4 * n} tokens ({4 * ex.num_supervised} supervised); "
        f"min {n}, median {n}, max {n}" in out
    )
    assert re.search(rf"^\s+{n}\s+\|#+ 4$", out, re.M), out  # the histogram's one bar
    rows = -(-4 // (128 // n))  # equal lengths: as many per row as fit
    plural = "s" if rows > 1 else ""
    assert (
        f"packing: data.pack=true: 4 examples in {rows} row{plural} of data.max_seq_len=128" in out
    )
    assert f"packing efficiency {4 * n / (128 * rows):.1%}" in out
    assert "bad lines: 1 of 5 (invalid_json 1)" in out
    assert "d.jsonl:4: invalid JSON" in out
    assert "predicted peak" in out and "fits the cpu budget" in out  # the planner's own text
    assert "nothing was written" in out


def test_text_format_supervises_all_but_the_first_token(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "Say hi. hello world"}])
    r = inspect(tmp_path, tiny_llama_dir, data, "text")
    assert r.code == 0, r
    [(first, rest)] = re.findall(r"^(\S+?)\[\[(.*?)<\|im_end\|>\]\]$", r.out, re.M)
    assert first + rest == "Say hi. hello world"


def test_packing_off_and_too_long_examples(tmp_path: Path, tiny_llama_dir: Path) -> None:
    long = {
        "messages": [{"role": "user", "content": "word " * 200}, RECORDS["chat"]["messages"][1]]
    }
    data = write_jsonl(tmp_path / "d.jsonl", [RECORDS["chat"], long, RECORDS["chat"]])
    r = inspect(
        tmp_path, tiny_llama_dir, data, "chat", "data.pack=false", "data.max_bad_fraction=0.5"
    )
    assert r.code == 0, r
    assert "packing: data.pack=false: one example per row, 2 rows" in r.out
    assert "bad lines: 1 of 3 (too_long 1)" in r.out
    assert "d.jsonl:2: too long" in r.out


def test_colour_on_a_terminal_and_plain_markers_otherwise(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [RECORDS["chat"]])
    r = inspect(tmp_path, tiny_llama_dir, data, "chat", "--color", "always")
    assert r.code == 0, r
    assert f"\x1b[1;32m{ANSWER}<|im_end|>\n\x1b[0m" in r.out and "[[" not in r.out
    r = inspect(tmp_path, tiny_llama_dir, data, "chat")  # not a terminal: markers
    assert "\x1b[" not in r.out and f"[[{ANSWER}" in r.out


def test_data_in_another_format_shows_the_bad_lines_and_exits_2(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [RECORDS["sharegpt"]] * 4)
    r = inspect(tmp_path, tiny_llama_dir, data, "chat")
    assert r.code == 2, r
    assert "bad lines: 4 of 4 (missing_field 4)" in r.out
    assert "d.jsonl:1: missing field 'messages'" in r.out
    assert "every record lacks 'messages' but has 'conversations'" in r.err
    assert "use data.format=sharegpt" in r.err


def test_a_tokenizer_without_a_template_is_given_data_chat_template(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    jinja = tmp_path / "t.jinja"
    jinja.write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    data = write_jsonl(tmp_path / "d.jsonl", [RECORDS["chat"]])
    r = inspect(tmp_path, tiny_llama_dir, data, "chat", f"data.chat_template={jinja}")
    assert r.code == 0, r
    assert f"<user>Say hi<|im_end|><assistant>[[{ANSWER}<|im_end|>]]" in r.out


def test_inspect_without_data_is_a_config_error(tmp_path: Path, tiny_llama_dir: Path) -> None:
    r = run_cli(["inspect", f"model.path={tiny_llama_dir}", "data.train=nope.jsonl"])
    assert r.code == 2 and "data.train" in r.err and "nope.jsonl" in r.err, r


def test_auto_lengths_and_packing_are_what_train_uses(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """With the defaults (data.max_seq_len=auto, data.pack=auto), inspect reports the rows train
    will build: as long as the longest example, and unpacked for a method that needs that."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Say hi " * (i + 1)},
                {"role": "assistant", "content": ANSWER},
            ]
        }
        for i in range(6)
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    args = [f"model.path={tiny_llama_dir}", f"data.train={data}", "data.eval=null"]
    r = run_cli(["inspect", *args])
    assert r.code == 0, r
    longest = int(re.search(r"max (\d+)", r.out)[1])  # type: ignore[index]
    assert f"of data.max_seq_len={longest};" in r.out
    trained = run_cli(["train", *args, f"run.dir={tmp_path / 'run'}", "run.progress=false"])
    assert trained.code == 0, trained
    assert f"data.max_seq_len=auto: {longest} tokens" in trained.out
    r = run_cli(["inspect", *args, "method.name=prompt"])
    assert r.code == 0, r
    assert "data.pack=false: one example per row, 6 rows" in r.out


PAIRS = [
    {"prompt": "What is 2 plus 2?", "chosen": "It is 4.", "rejected": "Maybe 5."},
    {"prompt": "What is 3 plus 3?", "chosen": "It is 6.", "rejected": "Maybe 7."},
    {"prompt": "What is 4 plus 4?", "chosen": "Same.", "rejected": "Same."},  # a bad line
]


def test_a_pair_shows_its_prompt_once_and_each_answers_supervised_span(
    tmp_path: Path, tiny_llama_dir: Path, tokenizer
) -> None:
    """train.objective=dpo: each pair's prompt once, then the chosen and the rejected answer
    with exactly their supervised tokens marked (the answer and its end of turn, as SFT's view
    marks them), counted as the tokenizer counts them; the rows of both answers; the plan with
    the reference's forward; data train would refuse exits 2."""
    data = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    extra = ["train.objective=dpo", "data.max_bad_fraction=0.5"]
    r = inspect(tmp_path, tiny_llama_dir, data, "preference", *extra)
    assert r.code == 0, r
    out = r.out
    first, second = out.split("--- pair 1 of 2 (d.jsonl:1)", 1)[1].split("--- pair 2 of 2", 1)
    assert first.count("What is 2 plus 2?") == 1 and "What is 2 plus 2?" not in second
    spans = re.findall(r"\[\[(.*?)\]\]", out.split("--- pair 1", 1)[1], re.S)
    answers = ["It is 4.", "Maybe 5.", "It is 6.", "Maybe 7."]
    assert spans == [f"{a}<|im_end|>\n" for a in answers], out
    pairs = preference_data(data, fmt="preference", tokenizer=tokenizer, max_bad_fraction=0.5)
    p = pairs.pairs[0]
    supervised = sum(t != -100 for t in p.chosen_labels)
    assert f"prompt ({len(p.prompt_ids)} tokens):" in first
    assert f"chosen ({len(p.chosen_ids)} tokens, {supervised} supervised):" in first
    assert f"rejected ({len(p.rejected_ids)} tokens, " in first
    # A row holds whole pairs, the prompt once per answer: both pairs fit one row of 256.
    rows = sum(2 * len(q.prompt_ids) + len(q.chosen_ids) + len(q.rejected_ids) for q in pairs.pairs)
    assert "packing: data.pack=true: 2 pairs in 1 row of up to 2 x data.max_seq_len=128" in out
    assert f"the longest row {rows})" in out
    assert "bad lines: 1 of 3" in out and "d.jsonl:3: chosen and rejected are identical" in out
    assert "reference forward (no grad)" in out and "nothing was written" in out
    # The whole default (max_bad_fraction) refuses a third bad, as train does.
    refused = inspect(tmp_path, tiny_llama_dir, data, "preference", "train.objective=dpo")
    assert refused.code == 2 and "bad lines: 1 of 3" in refused.out, refused


def test_an_unpaired_example_shows_its_completion_and_label(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    rows = [
        {"prompt": "What is 2 plus 2?", "completion": "It is 4.", "label": True},
        {"prompt": "What is 3 plus 3?", "completion": "Maybe 7.", "label": False},
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    r = inspect(tmp_path, tiny_llama_dir, data, "kto", "train.objective=kto", "data.pack=false")
    assert r.code == 0, r
    assert "--- example 2 of 2 (d.jsonl:2)" in r.out
    assert re.search(r"completion, label true \(desirable; \d+ tokens, \d+ supervised\)", r.out)
    assert "completion, label false (undesirable;" in r.out
    spans = re.findall(r"\[\[(.*?)\]\]", r.out.split("--- example 1", 1)[1], re.S)
    assert spans == ["It is 4.<|im_end|>\n", "Maybe 7.<|im_end|>\n"], r.out
    assert "packing: data.pack=false: one example per row, 2 rows" in r.out
