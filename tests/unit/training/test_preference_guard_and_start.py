"""A DPO run under the guard and from an SFT run (issue 34): a loss spike rolls it back to its
checkpoint exactly, with the reference still the base model's; `model.path` may be an SFT run
of leantune, which the DPO run starts from and records."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from support import make_config, run_cli, write_jsonl

from leantune.config.parse import ConfigError
from leantune.models.loading import ModelSource, load_model
from leantune.monitor.events import read_events
from leantune.monitor.metrics import read_metrics
from leantune.objectives.batch import PreferenceStep, with_reference
from leantune.testing.faults import LOSS_SCALE_ENV
from leantune.training import recipe
from leantune.training.guard import actions as guard_actions
from leantune.training.parallel.strategy import SingleProcess
from leantune.training.start_model import MADE_FROM, fingerprint_digest, start_model
from leantune.training.state.checkpoint import latest_checkpoint, load_checkpoint

PAIRS = [
    {"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.", "rejected": f"Maybe {i}."}
    for i in range(8)
]
DPO = (
    "train.objective=dpo",
    "data.format=preference",
    "data.max_seq_len=auto",
    "train.precision=fp32",
    "method.dropout=0",
    "data.pack=false",
    "train.lr=1e-3",
)


def _reference_of(step: PreferenceStep, model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """Every sequence's summed log-probs under `model` as it is now (what a reference
    computed from it would hold)."""
    fresh = with_reference(replace(step, reference=None), model, torch.device("cpu"), "fp32", 0)
    assert fresh.reference is not None
    return tuple(fresh.reference)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_loss_spike_rolls_a_dpo_run_back_to_its_checkpoint_exactly(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Step 5's loss and gradients x50: the guard restores step 4's checkpoint exactly (weights,
    Adam, schedule, RNG), skips the spiked pairs (named by their lines), and the run finishes.
    Full fine-tuning's reference stays the log-probs computed from the base before training,
    not those of the weights the rollback put back."""
    monkeypatch.setenv(LOSS_SCALE_ENV, "5:50")
    rolled: list[dict[str, Any]] = []
    original = guard_actions.rollback

    def spy(tr: recipe.Trainer, bad_end: int, lr_factor: float) -> None:
        path = latest_checkpoint(tr.files.ckpt_dir)
        assert path is not None and tr.objective is not None
        reference = tr.objective.reference
        original(tr, bad_end, lr_factor)
        rolled.append(
            {
                "ckpt": load_checkpoint(path),
                "weights": {n: p.detach().clone() for n, p in tr.params.items()},
                "adam": {
                    k: {n: v.clone() for n, v in st.items()}
                    for k, st in tr.optimizer.state_dict()["state"].items()
                },
                "sched": tr.scheduler.last_epoch,
                "rng": torch.get_rng_state(),
                "reference": (reference, tr.objective.reference),
                "step": tr.objective,
                "restored": _reference_of(tr.objective, tr.model) if method == "full" else None,
            }
        )

    monkeypatch.setattr(guard_actions, "rollback", spy)
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    run = tmp_path / "run"
    settings = ("train.max_steps=6", "train.save_every=2", "guard.loss_spike=rollback",
                "guard.warmup=3", f"method.name={method}")  # fmt: skip
    recipe.train(make_config(tiny_llama_dir, data, run, *DPO, *settings), log=lambda _: None)

    assert len(rolled) == 1
    info = rolled[0]
    ckpt = info["ckpt"]
    assert ckpt.state.step == 4
    assert all(torch.equal(info["weights"][n], w) for n, w in ckpt.weights.items())
    adam = ckpt.optimizer["state"]
    assert all(torch.equal(info["adam"][k][n], v) for k in adam for n, v in adam[k].items())
    assert info["sched"] == ckpt.scheduler["last_epoch"]
    assert torch.equal(info["rng"], ckpt.rng["torch"])
    events = read_events(run / "events.jsonl")
    assert [(e["kind"], e.get("action")) for e in events] == [
        ("loss_spike", "rollback"),
        ("rollback", None),
    ]
    assert events[0]["step"] == 5 and events[0]["ratio"] > 20
    # Step 5's 2 pairs (micro-batch 2, pack=false: a row is a pair, row i is line i+1).
    skipped = events[1]["skipped_rows"]
    assert len(skipped) == 2 and events[1]["skipped_lines"] == [r + 1 for r in skipped]
    steps = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(m["loss"]) and m["loss"] < 5 for m in steps)  # no spike kept
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert (run / "final").is_dir()
    before, after = info["reference"]
    if method == "lora":  # the adapter switched off: no log-probs kept
        assert before is None and after is None
        return
    base = _reference_of(info["step"], load_model(ModelSource(str(tiny_llama_dir))))
    assert after is before and len(after) == len(base) == 8
    assert all(torch.equal(a, b) for a, b in zip(after, base, strict=True))
    # Those of the restored weights differ: a reference taken after the restore would show.
    assert not all(torch.equal(a, b) for a, b in zip(after, info["restored"], strict=True))


@pytest.mark.parametrize(("sft_method", "given"), [("lora", "run"), ("full", "final")])
def test_a_dpo_run_starts_from_an_sft_run_and_records_it(
    tiny_llama_dir: Path,
    chat_files: tuple[Path, Path],
    tmp_path: Path,
    sft_method: str,
    given: str,
) -> None:
    """The two-stage recipe: model.path is an SFT run (its directory, or its final/). The DPO
    run starts from the SFT model (a LoRA run's adapter merged into its base, by the loader
    `eval` uses): its step-1 log-probs are the SFT model's, not the base's, its loss log 2,
    and its record and summary name the SFT run."""
    sft = tmp_path / "sft"
    sft_settings = (f"method.name={sft_method}", "train.max_steps=2", "train.precision=fp32")
    recipe.train(make_config(tiny_llama_dir, chat_files[0], sft, *sft_settings), log=print)
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    dpo = tmp_path / "dpo"
    start = sft if given == "run" else sft / "final"
    method = "lora" if sft_method == "lora" else "full"  # one start of each kind
    one_step = ("train.max_steps=1", "train.micro_batch_size=8", f"method.name={method}")
    recipe.train(make_config(start, data, dpo, *DPO, *one_step), log=print)

    (first,) = read_metrics(dpo / "metrics.jsonl")
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    margins = {}
    for model in (tiny_llama_dir, sft):
        done = run_cli(["eval", "--model", str(model), "--data", str(data)])
        assert done.code == 0, done
        margins[model] = json.loads(done.out[done.out.index("{") :])["mean_margin"]
    assert abs(margins[sft] - margins[tiny_llama_dir]) > 1e-2  # the SFT moved the model
    # The step's 8 pairs are the whole file: its mean margin is eval's of the SFT model.
    got = first["logps/chosen"] - first["logps/rejected"]
    assert got == pytest.approx(margins[sft], rel=1e-4, abs=1e-4)
    sft_record = json.loads((sft / "leantune_run.json").read_text())
    for file in ("leantune_run.json", "summary.json"):
        started = json.loads((dpo / file).read_text())["started_from"]
        assert started["run"] == str(sft.resolve()) and started["name"] == "sft", file
        assert started["fingerprint"] == fingerprint_digest(sft_record["fingerprint"]), file
    done = run_cli(["eval", "--model", str(dpo), "--data", str(data)])  # its final/ loads
    assert done.code == 0, done


def test_a_changed_sft_adapter_is_not_merged_over_a_run_that_started_from_it(
    tmp_path: Path,
) -> None:
    """Merging again would replace the base of the run's checkpoints and final/: refused,
    before anything loads, naming both folders and the ways out."""
    record = {"fingerprint": {}, "sources": {}, "split": [0, 0]}
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    (sft / "final").mkdir(parents=True)
    (sft / "final" / "adapter_config.json").write_text("{}")  # retrained since: another digest
    (dpo / "start_model").mkdir(parents=True)
    (dpo / "start_model" / MADE_FROM).write_text(json.dumps({"adapter": "an older one"}))
    for run in (sft, dpo):
        (run / "leantune_run.json").write_text(json.dumps(record))
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cfg = make_config(sft, data, dpo, *DPO)
    with pytest.raises(ConfigError, match=r"has changed since .* run\.resume=never"):
        start_model(cfg, SingleProcess(), lambda _: None)
    assert json.loads((dpo / "start_model" / MADE_FROM).read_text())["adapter"] == "an older one"


class _Rank:
    """A process of a torchrun world as `start_model` sees it: its rank, and the decision
    the world agrees on (the largest code any process gave)."""

    def __init__(self, main: bool, others: int = 0) -> None:
        self.is_main_process = main
        self.others = others
        self.given: list[int] = []

    def agree(self, code: int) -> int:
        self.given.append(code)
        return max(code, self.others)


def test_under_torchrun_rank_0_merges_and_a_failure_stops_every_rank(tmp_path: Path) -> None:
    """Rank 0 merges an SFT run's adapter while the others wait (one agree each); a merge
    that fails there tells the others (code 1), which stop naming rank 0 rather than hang, and
    a merged folder another process cannot see is said as such."""
    record = {"fingerprint": {}, "sources": {}, "split": [0, 0]}
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    (sft / "final").mkdir(parents=True)
    (sft / "final" / "adapter_config.json").write_text("{}")
    (sft / "leantune_run.json").write_text(json.dumps(record))
    cfg = make_config(sft, write_jsonl(tmp_path / "pairs.jsonl", PAIRS), dpo, *DPO)
    rank1 = _Rank(main=False)
    with pytest.raises(ConfigError, match=r"rank 0 merged .* cannot see: run\.dir must be"):
        start_model(cfg, rank1, lambda _: None)  # type: ignore[arg-type]
    assert rank1.given == [0]  # it waited for rank 0, and read nothing it had not written
    # A run that started from an older adapter: rank 0 refuses to merge over it.
    (dpo / "start_model").mkdir(parents=True)
    (dpo / "start_model" / MADE_FROM).write_text(json.dumps({"adapter": "an older one"}))
    (dpo / "leantune_run.json").write_text(json.dumps(record))
    rank0 = _Rank(main=True)
    with pytest.raises(ConfigError, match="has changed since"):
        start_model(cfg, rank0, lambda _: None)  # type: ignore[arg-type]
    assert rank0.given == [1]
    rank1 = _Rank(main=False, others=1)
    with pytest.raises(ConfigError, match=r"rank 0 could not merge .*sft/final: see its error"):
        start_model(cfg, rank1, lambda _: None)  # type: ignore[arg-type]
    assert rank1.given == [0]
