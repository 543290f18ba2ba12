"""Preference objectives through the one training loop: a DPO run on a tiny llama
starts at log 2 and logs the reward metrics, its step's loss is `dpo_loss` of the model's own
log-probs, a stopped run resumes bit-exactly, and simpo, orpo and kto train."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import (
    PAIRS,
    REWARDS,
    UNPAIRED,
    make_config,
    pref_args,
    run_cli,
    write_jsonl,
)

from leantune.config.parse import ConfigError
from leantune.core.signals import StopSignals
from leantune.data.preference_packing import pack_pairs
from leantune.models.loading import resolve_model
from leantune.monitor.events import read_events
from leantune.monitor.metrics import read_metrics
from leantune.objectives.batch import PreferenceStep
from leantune.objectives.logps import SequenceLogps, logits_token_logps, sequence_logps
from leantune.objectives.preference import PreferenceBatch, dpo_loss
from leantune.objectives.registry import OBJECTIVES, settings_for
from leantune.testing.faults import KILL_ENV, OOM_STEP_ENV
from leantune.training.checks import check_config
from leantune.training.preference_setup import load_preference_data
from leantune.training.recipe import Session, named_run, set_up, train
from leantune.training.run.fingerprint import trajectory_settings
from leantune.training.trainer import preference_window

SIGNAL_ENV = "LEANTUNE_SIGNAL_AT_MICRO_BATCH"


def test_a_dpo_run_starts_at_log_2_and_logs_the_rewards(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """LoRA's B starts at 0, so the policy is its reference at step 1: every pair's log-ratio
    is 0 and the DPO loss is exactly log 2; the reward metrics reach metrics.jsonl."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    run = tmp_path / "run"
    done = run_cli(pref_args(tiny_llama_dir, data, run, "dpo", "train.max_steps=3"))
    assert done.code == 0, done
    steps = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[0]["rewards/chosen"] == 0 and steps[0]["rewards/margins"] == 0
    assert all(key in m for m in steps for key in (*REWARDS, "logps/chosen", "logps/rejected"))
    assert steps[-1]["loss"] < math.log(2)  # trained: lr 1e-2 moves it within 2 updates
    assert steps[-1]["rewards/margins"] > 0
    assert (run / "final" / "adapter_model.safetensors").exists()
    # eval on pairs: the tuned model prefers the chosen answers by more than its base does.
    scores = {}
    for model in (tiny_llama_dir, run / "final"):
        done = run_cli(["eval", "--model", str(model), "--data", str(data)])
        assert done.code == 0, done
        scores[model] = json.loads(done.out[done.out.index("{") :])
    base, tuned = scores[tiny_llama_dir], scores[run / "final"]
    assert tuned["pairs"] == 8 and tuned["format"] == "preference"
    assert tuned["mean_margin"] > base["mean_margin"]
    assert 0 <= base["preference_accuracy"] <= tuned["preference_accuracy"] <= 1


@pytest.fixture(scope="module")
def dpo_session(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Session:
    """A 1-step DPO run on 4 pairs (packed in one row), set up again as the same command does:
    the trainer as the run left it (policy and reference differ after the update)."""
    tmp = tmp_path_factory.mktemp("dpo")
    data = write_jsonl(tmp / "pairs.jsonl", PAIRS[:4])
    cfg = make_config(
        tiny_llama_dir,
        data,
        tmp / "run",
        "data.format=preference",
        "train.objective=dpo",
        "train.max_steps=1",
        "train.micro_batch_size=4",
        "train.precision=fp32",
        "method.dropout=0",
    )
    train(cfg, log=lambda _: None)
    source = resolve_model(cfg.model.path, None)
    cfg = named_run(cfg, source.location, None)
    session = set_up(cfg, source, stop=StopSignals(), inputs=[], log=lambda _: None)
    assert session.trainer.state.step == 1
    return session


def test_the_step_loss_is_dpo_of_the_models_own_log_probs(dpo_session: Session) -> None:
    """Two packed pairs in one row, after one update: the loop's objective output equals
    `dpo_loss` of log-probs from the model's own forward (full logits) on each sequence alone,
    with the adapter on and off (a row whose sequences saw each other would differ)."""
    session, cfg = dpo_session, dpo_session.cfg
    step = session.trainer.objective
    assert isinstance(step, PreferenceStep)
    model = session.model
    model.eval()
    rows = [i for i, r in enumerate(step.rows) if len(r.segments) >= 4][:1]
    assert rows, "two pairs packed in one row"
    mb = step.collate(rows, session.trainer.pad_id)
    with torch.no_grad():
        out = step.output(model, mb)
    chosen, rejected, ref_c, ref_r = [], [], [], []
    for i in rows:
        for s in step.rows[i].segments:
            ids = torch.tensor([step.rows[i].input_ids[s.start : s.end]])
            labels = torch.tensor([step.rows[i].labels[s.start : s.end]])
            with torch.no_grad():
                own = model(input_ids=ids).logits
                with model.disable_adapter():
                    ref = model(input_ids=ids).logits
            pol = sequence_logps(logits_token_logps(own, labels), labels)
            base = sequence_logps(logits_token_logps(ref, labels), labels)
            (chosen if s.answer == "chosen" else rejected).append(pol)
            (ref_c if s.answer == "chosen" else ref_r).append(base.sums)

    def cat(xs: list[SequenceLogps]) -> SequenceLogps:
        return SequenceLogps(torch.cat([x.sums for x in xs]), torch.cat([x.counts for x in xs]))

    spec = OBJECTIVES["dpo"]
    expected = dpo_loss(
        PreferenceBatch(cat(chosen), cat(rejected), torch.cat(ref_c), torch.cat(ref_r)),
        settings_for(spec, cfg.preference),
    )
    assert out.examples == expected.examples >= 2
    assert float(out.loss()) == pytest.approx(float(expected.loss()), abs=1e-5)
    assert float(out.loss()) != pytest.approx(math.log(2), abs=1e-4)  # the update moved it
    got, want = out.metrics(), expected.metrics()
    for key in (*REWARDS, "logps/chosen", "logps/rejected"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key


def test_two_micro_batches_give_the_gradient_of_one_twice_as_large(dpo_session: Session) -> None:
    """The window's arithmetic: each micro-batch's loss is over the window's pairs, so 4 pairs
    in micro-batches of 2 give the loss, gradients and metrics of one micro-batch of 4."""
    run = load_preference_data(dpo_session.cfg, dpo_session.tokenizer, None, lambda _: None)[1]
    packed = dpo_session.trainer.objective
    assert isinstance(packed, PreferenceStep)
    step = replace(packed, rows=pack_pairs(run.data.pairs, None))  # one pair per row
    assert len(step.rows) == 4
    params = dpo_session.trainer.params

    def window(split: list[list[int]]) -> tuple[float, dict[str, float], list[torch.Tensor]]:
        for p in params.values():
            p.grad = None
        batches = [step.collate(m, dpo_session.trainer.pad_id) for m in split]
        model = dpo_session.trainer.model
        loss, metrics = preference_window(step, model, batches, torch.device("cpu"), "fp32")
        return loss, metrics, [p.grad.clone() for p in params.values() if p.grad is not None]

    one_loss, one_metrics, one_grads = window([[0, 1, 2, 3]])
    two_loss, two_metrics, two_grads = window([[0, 1], [2, 3]])
    assert two_loss == pytest.approx(one_loss, abs=1e-6)
    assert two_metrics.keys() == one_metrics.keys() and set(REWARDS) <= set(one_metrics)
    for key, value in one_metrics.items():
        assert two_metrics[key] == pytest.approx(value, abs=1e-5), key
    assert len(one_grads) == len(two_grads) == len(params)
    for a, b in zip(one_grads, two_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _resumable(method: str, save_every: int, reference: str = "auto") -> tuple[str, ...]:
    """The resume tests' settings: 4 steps of 2 micro-batches of one pair."""
    return (
        f"method.name={method}",
        "train.lr=1e-3",
        "train.max_steps=4",
        "train.micro_batch_size=1",
        "train.grad_accum=2",
        "data.pack=false",
        f"train.save_every={save_every}",
        f"train.reference={reference}",
    )


@pytest.fixture(scope="module")
def uninterrupted(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """The run directory of the resume tests' run without interruption, per method and
    train.reference (made once: the stopped and the killed runs compare with the same one)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    data = write_jsonl(tmp / "pairs.jsonl", PAIRS)
    done: dict[tuple[str, str], Path] = {}

    def run(method: str, reference: str = "auto") -> Path:
        if (method, reference) not in done:
            out = tmp / f"{method}-{reference}"
            args = pref_args(tiny_llama_dir, data, out, "dpo", *_resumable(method, 0, reference))
            assert run_cli(args).code == 0
            done[method, reference] = out
        return done[method, reference]

    return run


@pytest.mark.parametrize(
    ("method", "weights", "reference"),
    [("lora", "adapter_model", "auto"), ("full", "model", "auto"), ("full", "model", "live")],
)
def test_a_stopped_dpo_run_resumes_bit_exactly(
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    uninterrupted: Callable[[str], Path],
    method: str,
    weights: str,
    reference: str,
) -> None:
    """SIGTERM in step 3 (checkpoint of step 2), then the same command: the metrics and the
    final weights equal the uninterrupted run's exactly (CPU fp32). Full fine-tuning's
    reference log-probs are computed before the resume restores the trained weights, so they
    are the base model's on both runs (after the restore, steps 3-4 would differ); the resume
    reads them from the file its first start kept; train.reference=live copies the model
    before the restore too."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    straight = uninterrupted(method, reference)
    run = tmp_path / "run"
    args = pref_args(tiny_llama_dir, data, run, "dpo", *_resumable(method, 0, reference))
    monkeypatch.setenv(SIGNAL_ENV, "4:TERM")  # micro-batch 4: the first of step 3
    stopped = run_cli(args)
    monkeypatch.delenv(SIGNAL_ENV)
    assert stopped.code == 143, stopped
    resumed = run_cli(args)
    assert resumed.code == 0 and "resumed from" in resumed.out, resumed
    if method == "full" and reference == "auto":  # kept by its first start in prepared/
        assert "reference: log-probs of 16 sequences loaded from" in resumed.out, resumed
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr", *REWARDS):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert a[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the reference is the base
    wa = load_file(straight / "final" / f"{weights}.safetensors")
    wb = load_file(run / "final" / f"{weights}.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize(
    ("method", "weights"),
    [
        ("lora", "adapter_model"),
        # slow: the child process's start (~10 s) again; the stopped run's test covers full
        # fine-tuning's reference across a resume in the default suite.
        pytest.param("full", "model", marks=pytest.mark.slow),
    ],
)
def test_a_dpo_run_killed_mid_step_resumes_bit_exactly(
    tiny_llama_dir: Path,
    tmp_path: Path,
    uninterrupted: Callable[[str], Path],
    method: str,
    weights: str,
) -> None:
    """SIGKILL (no handler runs) after the first micro-batch of step 3, the checkpoint of step
    2 on disk; the same command resumes from it: the metrics and the final weights equal the
    uninterrupted run's exactly (CPU fp32). lora's reference is the adapter switched off; full
    fine-tuning's is computed again from the base before the restore, as on the first start."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    straight = uninterrupted(method)
    run = tmp_path / "run"
    args = pref_args(tiny_llama_dir, data, run, "dpo", *_resumable(method, 2))
    killed = _in_a_process(args, {KILL_ENV: "4"})  # micro-batch 4: the first of step 3
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2]
    resumed = run_cli(args)
    assert resumed.code == 0 and "resumed from" in resumed.out and "step 2" in resumed.out
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr", *REWARDS, "logps/chosen", "logps/rejected"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert a[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the reference is the base
    wa = load_file(straight / "final" / f"{weights}.safetensors")
    wb = load_file(run / "final" / f"{weights}.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _in_a_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`leantune ARGS` in a child process (a SIGKILL ends it, not the tests), with `env`'s
    fault variables and no others."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEANTUNE_")}
    src = str(Path(__file__).resolve().parents[3] / "src")
    return subprocess.run(
        [sys.executable, "-m", "leantune", *args],
        env={**clean, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_oom_in_a_dpo_step_replays_it_with_half_the_micro_batch(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A simulated OOM in step 2 halves the micro-batch and replays the same pairs: every step
    equals a run with micro-batch 1 from the start (global batch 4 kept), up to rounding."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    fixed = ("train.max_steps=3", "data.pack=false", "train.global_batch_size=4")
    small = tmp_path / "small"
    one = ("train.micro_batch_size=1", "train.grad_accum=4")
    assert run_cli(pref_args(tiny_llama_dir, data, small, "dpo", *fixed, *one)).code == 0
    run = tmp_path / "run"
    monkeypatch.setenv(OOM_STEP_ENV, "2")
    two = ("train.micro_batch_size=2", "train.grad_accum=2")
    assert run_cli(pref_args(tiny_llama_dir, data, run, "dpo", *fixed, *two)).code == 0
    a, b = read_metrics(small / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [m["micro_batch_size"] for m in b] == [2, 1, 1]
    assert [e["kind"] for e in read_events(run / "events.jsonl")].count("oom") == 1
    for key in ("loss", "grad_norm", *REWARDS):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], abs=1e-5), key


@pytest.mark.parametrize(
    ("objective", "metric"),
    [("simpo", "rewards/margins"), ("orpo", "log_odds_ratio"), ("kto", "kl")],
)
def test_simpo_orpo_and_kto_train(
    tiny_llama_dir: Path, tmp_path: Path, objective: str, metric: str
) -> None:
    rows = UNPAIRED if objective == "kto" else PAIRS
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run = tmp_path / "run"
    done = run_cli(pref_args(tiny_llama_dir, data, run, objective, "train.max_steps=2"))
    assert done.code == 0, done
    steps = read_metrics(run / "metrics.jsonl")
    assert len(steps) == 2 and all(math.isfinite(m["loss"]) and metric in m for m in steps)
    if objective == "kto":  # policy == reference at step 1: every loss is 1 - sigmoid(0)
        assert steps[0]["loss"] == pytest.approx(0.5, abs=1e-6)
        assert steps[0]["kl"] == 0


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("data.format=preference",), "train.objective=dpo"),
        (("train.objective=dpo", "data.format=alpaca"), "data.format=preference"),
        (("train.objective=kto", "data.format=preference"), "data.format=kto"),
        (("train.objective=orpo", "data.format=preference", "method.name=prompt"), "row"),
    ],
)
def test_the_objective_and_the_data_format_are_checked_together(
    tiny_llama_dir: Path, tmp_path: Path, overrides: tuple[str, ...], says: str
) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        check_config(make_config(tiny_llama_dir, data, tmp_path / "run", *overrides))


def test_full_fine_tuning_needs_no_reference_for_simpo(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cfg = make_config(
        tiny_llama_dir,
        data,
        tmp_path / "run",
        "train.objective=simpo",
        "data.format=preference",
        "method.name=full",
    )
    check_config(cfg)


def test_the_fingerprint_holds_the_objective_only_for_preference_runs(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """An SFT run's fingerprint is as before (its run name and resume do not change); a
    preference run's holds the objective and its settings, so another beta is another run."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    sft = trajectory_settings(make_config(tiny_llama_dir, data, tmp_path / "a"))
    assert not any(k == "train.objective" or k.startswith("preference.") for k in sft)
    pref = ("train.objective=dpo", "data.format=preference")
    dpo = trajectory_settings(make_config(tiny_llama_dir, data, tmp_path / "b", *pref))
    assert dpo["train.objective"] == "dpo" and dpo["preference.beta"] is None
    other = make_config(tiny_llama_dir, data, tmp_path / "b", *pref, "preference.beta=0.5")
    assert trajectory_settings(other)["preference.beta"] == 0.5
