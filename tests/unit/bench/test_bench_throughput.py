"""`leantune bench throughput` end to end on the tiny model: both systems train the same
examples, each in its own process, and the result says so in numbers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from support import run_cli

from leantune.bench.chat_corpus import write_corpus
from leantune.bench.throughput import (
    child_failure,
    flops_per_token,
    hf_command,
    leantune_command,
    one_run,
    parser,
    run_benchmark,
)
from leantune.cli.crash import one_line
from leantune.core.allocator import find_tcmalloc, library_dirs, preloaded_environment
from leantune.core.writes import WriteRefused
from leantune.errors import UserError
from leantune.layout import RunPaths
from leantune.models.loading import load_tokenizer, resolve_model


def test_corpus_spreads_lengths_and_turns(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(resolve_model(str(tiny_llama_dir)), False)
    path = write_corpus(tmp_path / "c.jsonl", tok, 40, seed=0, min_tokens=40, max_tokens=400)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    turns = {len(r["messages"]) // 2 for r in records}
    lengths = [
        len(tok(tok.apply_chat_template(r["messages"], tokenize=False))["input_ids"])
        for r in records
    ]
    assert turns == {1, 2, 3, 4}
    assert min(lengths) < 120 and max(lengths) > 250  # a real spread, not one length
    again = write_corpus(tmp_path / "d.jsonl", tok, 40, seed=0, min_tokens=40, max_tokens=400)
    assert again.read_text() == path.read_text()  # seeded


def test_flops_per_token_counts_weight_gradients_only_for_full(tiny_llama_dir: Path) -> None:
    lora = flops_per_token(str(tiny_llama_dir), "lora", 0)
    full = flops_per_token(str(tiny_llama_dir), "full", 0)
    assert full == lora * 1.5


def test_the_baseline_trains_on_the_targets_leantune_trains_on(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """transformers' causal LM loss shifts the labels it is given; leantune's are stored shifted
    (`labels[i]` is the target of position i). The baseline's rows must ask HF's loss for the
    same targets: the loss HF computes on them equals the loss of leantune's own labels."""
    import torch
    from transformers import AutoModelForCausalLM

    from leantune.bench.hf_baseline import _rows
    from leantune.data.dataset import prepared_data
    from leantune.data.prepare.records import PrepareSettings

    tok = load_tokenizer(resolve_model(str(tiny_llama_dir)), False)
    path = write_corpus(tmp_path / "c.jsonl", tok, 4, seed=0, min_tokens=40, max_tokens=200)
    settings = PrepareSettings(format="chat", max_seq_len=512, pack=False)
    ours = prepared_data(path, settings=settings, tokenizer=tok, max_bad_fraction=1.0).rows
    theirs = _rows(path, tok, 512)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    assert len(theirs) == len(ours) == 4
    for hf, row in zip(theirs, ours, strict=True):
        ids = torch.tensor([hf["input_ids"]])
        assert hf["input_ids"] == list(row.input_ids)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
            hf_loss = model(ids, labels=torch.tensor([hf["labels"]])).loss
        want = torch.nn.functional.cross_entropy(
            logits, torch.tensor(row.labels, dtype=torch.long), ignore_index=-100
        )
        assert torch.allclose(hf_loss, want, atol=1e-5), (hf_loss, want)


# Slow: three training children (the baseline, leantune's defaults, the same updates), ~28 s on
# an idle 2-core machine, over the default suite's budget; run with `pytest -m slow`.
@pytest.mark.slow
def test_both_systems_train_the_same_examples(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the tiny shape with random weights (`--model-shape`, as at 0.5B and 1.5B), both
    comparisons: leantune's defaults, and the same updates as the baseline."""
    # As under `leantune bench throughput`, which runs with the tcmalloc it preloaded.
    tcmalloc = find_tcmalloc(library_dirs(os.environ))
    assert tcmalloc, "tcmalloc is not installed: apt-get install libtcmalloc-minimal4"
    for k, v in preloaded_environment({}, tcmalloc).items():
        monkeypatch.setenv(k, v)
    args = parser().parse_args(
        ["--model-shape", "tiny", "--tokenizer", str(tokenizer_dir), "--conversations", "16",
         "--heldout", "4", "--reps", "1", "--methods", "lora", "--threads", "1",
         "--min-tokens", "20", "--max-tokens", "60",
         "--max-seq-len", "512", "--out", str(tmp_path / "bench"), "--hf-micro-batch", "4",
         "--precision", "fp32"]
    )  # fmt: skip
    logged: list[str] = []
    result = run_benchmark(args, log=logged.append)
    assert (result["model_shape"], result["weights"]) == ("tiny", "random")
    assert "random weights" in logged[0] and "not a quality figure" in logged[0]
    runs = {r["updates"]: r for r in result["runs"]}
    hf, ours = runs["baseline"], runs["defaults"]
    assert (hf["system"], ours["system"]) == ("hf_trainer_peft", "leantune")
    # leantune preloads tcmalloc for itself; the baseline keeps the allocator its user has.
    assert (ours["allocator"], hf["allocator"]) == ("tcmalloc", "glibc")
    # --precision fp32: both in fp32, on any CPU (what auto picks where bf16 matmul is slow).
    assert (ours["precision"], hf["precision"], result["precision"]) == ("fp32",) * 3
    assert hf["useful_tokens"] == ours["useful_tokens"] > 0  # every example once, both
    assert hf["examples"] == 16 and hf["steps"] == 2  # batch 8 (4 x 2 accumulated), one epoch
    assert (hf["micro_batch_size"], hf["grad_accum"]) == (4, 2)
    assert result["hf_batch"] == {"micro_batch_size": 4, "grad_accum": 2}
    assert hf["processed_tokens"] > hf["useful_tokens"]  # the padding collator pads
    lines = (tmp_path / "bench" / "runs.jsonl").read_text().splitlines()  # what a stop leaves
    kept = [json.loads(x) for x in lines]
    keys = ("system", "useful_tokens", "heldout_loss")  # each run whole, judged
    assert [tuple(r[k] for k in keys) for r in kept] == [
        tuple(r[k] for k in keys) for r in result["runs"]
    ]
    # Its MFU against the first peak reading (all a stopped benchmark has), the result's
    # against the higher of both readings: the same work at the same speed.
    before, best = result["matmul_peak_readings"]["before"]["fp32"], result["matmul_peak_gflops"]
    for k, r in zip(kept, result["runs"], strict=True):
        assert k["mfu"] * before == pytest.approx(r["mfu"] * best["fp32"])
    # MFU against the higher of two peak readings, before and after the runs.
    readings = result["matmul_peak_readings"]
    assert result["matmul_peak_gflops"] == {
        p: max(readings["before"][p], readings["after"][p]) for p in ("fp32", "bf16")
    }
    row = result["results"]["lora"]
    for system in ("hf_trainer_peft", "leantune"):
        r = row[system]
        assert r["peak_rss_bytes"] > 50 * 2**20 and 0 < r["mfu"] < 1
        assert 0 < r["heldout_loss"] < 20
    ratio = row["ratios"]["useful_tokens_per_s"]
    assert ratio == (
        row["leantune"]["useful_tokens_per_s"] / row["hf_trainer_peft"]["useful_tokens_per_s"]
    )
    # --updates both (the default): leantune once more with the baseline's updates, judged
    # against the same baseline run; 16 examples in batches of 8 make 2 updates for both.
    same = [r for r in result["runs"] if r["updates"] == "same"]
    assert [(r["system"], r["steps"]) for r in same] == [("leantune", 2)]
    assert same[0]["useful_tokens"] == hf["useful_tokens"]
    # Its updates are the baseline's by construction, not by the rounding of packed rows that
    # gives the defaults their count: one example per row, 8 rows per update, unpadded.
    saved = yaml.safe_load(RunPaths(tmp_path / "bench" / "leantune-lora-0-same").config.read_text())
    assert saved["data"]["pack"] is False
    assert (saved["train"]["micro_batch_size"], saved["train"]["grad_accum"]) == (1, 8)
    assert (
        yaml.safe_load(RunPaths(tmp_path / "bench" / "leantune-lora-0").config.read_text())["data"][
            "pack"
        ]
        is not False
    )
    # Judged runs keep their record, not their weights (--keep-models keeps them).
    for run in ("hf_trainer_peft-lora-0", "leantune-lora-0", "leantune-lora-0-same"):
        assert not list((tmp_path / "bench" / run).rglob("*.safetensors")), run
    assert RunPaths(tmp_path / "bench" / "leantune-lora-0").summary.is_file()
    both = result["same_updates"]["lora"]
    assert both["hf_trainer_peft"] == row["hf_trainer_peft"]  # one baseline, two comparisons
    assert both["leantune"]["steps"] == both["hf_trainer_peft"]["steps"] == 2
    assert both["ratios"]["updates"] == 1.0
    assert both["leantune"]["useful_tokens_per_s"] == same[0]["useful_tokens_per_s"]


def test_leantune_gets_a_precision_only_when_the_benchmark_names_one(tmp_path: Path) -> None:
    train, out = tmp_path / "t.jsonl", tmp_path / "run"
    assert not any(
        a.startswith("train.precision") for a in leantune_command("m", train, "lora", out)
    )
    cmd = leantune_command("m", train, "full", out, "fp32")
    assert [a for a in cmd if a.startswith("train.precision")] == ["train.precision=fp32"]
    hf = hf_command("m", train, "full", out, "fp32", 2, 8)
    assert hf[hf.index("--precision") + 1] == "fp32"
    assert parser().parse_args([]).precision == "auto"


def test_the_baseline_micro_batch_must_divide_its_batch() -> None:
    assert parser().parse_args([]).hf_micro_batch == 8
    result = run_cli(["bench", "throughput", "--hf-micro-batch", "3"])
    assert result.code == 2 and "must divide 8" in result.err


def test_the_cli_shows_the_benchmark_help() -> None:
    result = run_cli(["bench", "throughput", "--help"])
    assert result.code == 0 and "--conversations" in result.out


def test_a_child_that_met_a_full_disk_is_the_users_error_naming_its_folder(
    tmp_path: Path,
) -> None:
    """The baseline saving its model onto a full disk (what its process printed, 2026-12-06):
    exit 2 naming the run's folder, not leantune's internal error."""
    out = tmp_path / "hf_trainer_peft-lora-1"
    printed = (
        "Writing model shards:   0%|          | 0/1\nTraceback (most recent call last):\n"
        '  File "hf_baseline.py", line 116, in run\n'
        "safetensors._safetensors_rust.SafetensorError: Error while serializing: I/O error: "
        "No space left on device (os error 28)\n"
    )
    found = child_failure("hf_trainer_peft lora rep 1", 1, printed, out)
    assert isinstance(found, WriteRefused) and found.exit_code == 2
    assert str(out) in str(found) and "No space left on device [ENOSPC]" in str(found)


def test_a_failed_child_is_reported_by_its_own_last_line_first() -> None:
    """The one line an internal error prints holds the start of its message: the child's
    exception, not the warnings that lead its output."""
    printed = "W1206 a torch warning " * 60 + "\nTraceback ...\nValueError: bad shape (3, 4)\n\n"
    found = child_failure("leantune lora rep 0", 1, printed, Path("runs/x"))
    assert not isinstance(found, WriteRefused)
    assert one_line(found).startswith("leantune lora rep 0 failed (exit 1): ValueError: bad shape")
    assert printed in str(found)  # the whole output still goes to the crash log


def test_a_baseline_killed_for_memory_is_the_users_to_choose_around(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 1.5B baseline at batch 8 was killed at 20.8 GiB on a 24 GiB machine (2026-12-06):
    not leantune's bug (exit 70) but the user's choice of micro-batch, with the flag to use."""
    killed = (-9, int(20.8 * 2**30), 60.0, "Loading weights: 100%")
    monkeypatch.setattr("leantune.bench.throughput.run_child", lambda *a, **k: killed)
    ctx = {"model": "m", "train": tmp_path / "t.jsonl", "precision": "bf16", "threads": 2}
    with pytest.raises(UserError, match=r"20\.8 GiB: lower its micro-batch .* --hf-micro-batch 4"):
        one_run("hf_trainer_peft", "lora", tmp_path, 0, {**ctx, "hf_micro_batch": 8}, print)
