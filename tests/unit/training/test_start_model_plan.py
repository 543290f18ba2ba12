"""`leantune plan` and `leantune inspect` with a leantune SFT run as model.path (issue 34): they
read the model `train` would train from, through the resolver `train` uses
(`training.start_model.start_sources`): a full run's `final/`, a LoRA run's adapter on its base
(merged by `train`), with the adapter's own tokenizer. Each result equals the one for the model
`train` actually starts from (`start_model`'s merged copy), and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import chat_rows, make_config, run_cli, write_jsonl

from leantune.config.parse import ConfigError
from leantune.training import recipe
from leantune.training.parallel.strategy import SingleProcess
from leantune.training.start_model import start_model

PAIRS = [
    {"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.", "rejected": f"Maybe {i}."}
    for i in range(6)
]
TEMPLATE = "zephyr"
"""The SFT runs' own chat template: saved with their tokenizer, it is not the base model's, so
a plan or inspection that read the base's tokenizer counts other tokens."""


@pytest.fixture(scope="module")
def sft_runs(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 1-step SFT run per method (lora, full) on the tiny Llama."""
    root = tmp_path_factory.mktemp("sft_runs")
    data = write_jsonl(root / "chat.jsonl", chat_rows(4))
    runs = {}
    for method in ("lora", "full"):
        run = root / method
        settings = (f"method.name={method}", "train.max_steps=1", f"data.chat_template={TEMPLATE}")
        recipe.train(make_config(tiny_llama_dir, data, run, *settings), log=lambda _: None)
        runs[method] = run
    return runs


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _trained_from(sft: Path, data: Path, tmp_path: Path) -> Path:
    """The model `train` starts from with model.path=`sft` (an adapter merged into its base)."""
    cfg = make_config(sft, data, tmp_path / "dpo", "train.objective=dpo", "data.format=preference")
    resolved, origin = start_model(cfg, SingleProcess(), lambda _: None)
    assert origin is not None and origin.run == sft.resolve()
    return Path(resolved.model.path)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_plan_and_inspect_read_an_sft_run_as_train_starts_from_it(
    sft_runs: dict[str, Path], tiny_llama_dir: Path, tmp_path: Path, method: str
) -> None:
    sft = sft_runs[method]
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    trained = _trained_from(sft, data, tmp_path)
    merged = method == "lora"  # into the DPO run's start_model/
    assert (trained == (sft / "final").resolve()) is not merged
    before = _files(sft) | _files(tmp_path)
    common = [
        f"data.train={data}",
        "train.objective=dpo",
        "data.max_seq_len=auto",
        f"run.dir={tmp_path / 'planned'}",
        "train.memory_budget=64GiB",  # not the memory free now, which differs between calls
    ]
    got = {}
    for name, model in (
        ("run", sft),
        ("final", sft / "final"),
        ("trained", trained),
        ("base", tiny_llama_dir),
    ):
        plan = run_cli(["plan", "--json", f"model.path={model}", *common])
        assert plan.code == 0, plan
        shown = run_cli(["inspect", f"model.path={model}", *common])
        assert shown.code == 0, shown
        # The first line names model.path as given; the rest is what was read.
        got[name] = (json.loads(plan.out)["configured"], shown.out.split("\n", 1)[1])
    assert got["run"] == got["trained"] == got["final"]
    assert got["run"][0]["supervised_per_row"] > 0
    # The SFT run's tokenizer (its chat template), not its base model's, read the pairs.
    assert got["base"][1] != got["run"][1]
    assert _files(sft) | _files(tmp_path) == before  # plan and inspect wrote nothing


@pytest.mark.parametrize(
    ("method", "kind"), [("adapter", "bottleneck"), ("prompt", "PROMPT_TUNING")]
)
def test_plan_and_inspect_refuse_an_unmergeable_run_as_train_does(
    tiny_llama_dir: Path, tmp_path: Path, method: str, kind: str
) -> None:
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    sft = tmp_path / method
    settings = (f"method.name={method}", "train.max_steps=1", "data.pack=false")
    recipe.train(make_config(tiny_llama_dir, chat, sft, *settings), log=lambda _: None)
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cfg = make_config(sft, data, tmp_path / "dpo", "train.objective=dpo", "data.format=preference")
    with pytest.raises(ConfigError) as refused:
        start_model(cfg, SingleProcess(), lambda _: None)
    message = str(refused.value)
    assert kind in message and "cannot be merged" in message
    common = [f"model.path={sft}", f"data.train={data}", "train.objective=dpo"]
    for command in (["plan", "--json"], ["inspect"]):
        result = run_cli([*command, *common])
        assert result.code == 2 and message in result.err, (command, result)
