"""Full and freeze's DPO reference (issue 34): its log-probs are kept with the tokenised data,
keyed by the model and the rows, and read back by the next start (bit-exact with computing
them); a damaged or foreign file is computed again; train.reference=live keeps a frozen copy
instead and gives the same losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import PAIRS, make_config, pref_args, run_cli, write_jsonl

from leantune.config.parse import ConfigError
from leantune.data.preference_packing import PreferenceRow, Segment
from leantune.monitor.metrics import read_metrics
from leantune.objectives.reference import read_reference, reference_key, write_reference
from leantune.training.checks import check_config
from leantune.training.run.fingerprint import trajectory_settings

FULL = ("method.name=full", "train.lr=1e-3", "train.max_steps=3", "train.save_every=0")
COMPUTED = "computed once by the model before training"
LOADED = "reference: log-probs of 16 sequences loaded from"


def _run(model: Path, data: Path, run: Path, *extra: str) -> tuple[str, list[dict], dict]:
    """A 3-step full DPO run: its output, metrics and final weights."""
    done = run_cli(pref_args(model, data, run, "dpo", *FULL, *extra))
    assert done.code == 0, done
    weights = load_file(run / "final" / "model.safetensors")
    return done.out, read_metrics(run / "metrics.jsonl"), weights


def _same_run(a: tuple[str, list[dict], dict], b: tuple[str, list[dict], dict]) -> None:
    """Equal metrics (every key but the timings) and equal final weights, exactly."""
    for key in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert [m[key] for m in a[1]] == [m[key] for m in b[1]], key
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_a_second_run_reads_the_reference_and_trains_the_same(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Two runs sharing data.cache_dir: the first computes and keeps the reference, the second
    loads it and ends with the same weights; a damaged file is computed again, to the same run."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    first = _run(tiny_llama_dir, data, tmp_path / "a", cache)
    assert COMPUTED in first[0] and "kept in" in first[0] and LOADED not in first[0]
    [file] = (tmp_path / "cache").glob("reference-*.safetensors")
    second = _run(tiny_llama_dir, data, tmp_path / "b", cache)
    assert f"{LOADED} {file}" in second[0] and COMPUTED not in second[0]
    _same_run(first, second)
    raw = bytearray(file.read_bytes())
    raw[-1] ^= 0x40  # one bit of the last log-prob: only the checksum can see it
    file.write_bytes(bytes(raw))
    third = _run(tiny_llama_dir, data, tmp_path / "c", cache)
    assert COMPUTED in third[0] and LOADED not in third[0]
    _same_run(first, third)


def _rows(counts: list[int]) -> list[PreferenceRow]:
    return [
        PreferenceRow([1] * n, [1] * n, list(range(n)), [0] * n, (Segment(0, "chosen", 0, n),) * n)
        for n in counts
    ]


def test_only_an_intact_file_of_the_same_key_and_rows_is_read(tmp_path: Path) -> None:
    rows = _rows([2, 3])
    key = reference_key({"model.files": "sha256:ab"}, {"precision": "fp32"}, rows)
    sums = (torch.tensor([-1.5, -2.25]), torch.tensor([-0.5, -3.0, -7.125]))
    file = tmp_path / "ref.safetensors"
    write_reference(file, key, sums)
    got = read_reference(file, key, rows)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, sums, strict=True))
    assert read_reference(tmp_path / "absent.safetensors", key, rows) is None
    other = reference_key({"model.files": "sha256:cd"}, {"precision": "fp32"}, rows)
    assert other != key and read_reference(file, other, rows) is None
    assert reference_key({"model.files": "sha256:ab"}, {"precision": "fp32"}, _rows([2, 4])) != key
    assert reference_key({"model.files": "sha256:ab"}, {"precision": "bf16"}, rows) != key
    assert read_reference(file, key, _rows([3, 2])) is None  # another split into rows
    raw = file.read_bytes()
    file.write_bytes(raw[: len(raw) - 3])  # torn
    assert read_reference(file, key, rows) is None
    file.write_bytes(raw[:-4] + bytes(4))  # the last sum zeroed: the checksum differs
    assert read_reference(file, key, rows) is None


def test_live_and_cached_give_the_same_losses(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """train.reference=live runs a frozen copy per micro-batch: steps 1..3 match the cached
    reference (CPU fp32; the copy's forward pads its micro-batch, not the pass's 8 rows)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cached = _run(tiny_llama_dir, data, tmp_path / "cached")
    live = _run(tiny_llama_dir, data, tmp_path / "live", "train.reference=live")
    assert "reference: a frozen copy of the model, run on every micro-batch" in live[0]
    assert COMPUTED not in live[0], live[0]
    assert not list((tmp_path / "live" / "prepared").glob("reference-*"))
    for key in ("loss", "grad_norm", "rewards/margins", "logps/rejected"):
        got = torch.tensor([m[key] for m in live[1]], dtype=torch.float64)
        want = torch.tensor([m[key] for m in cached[1]], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=key)
    assert cached[1][0]["loss"] == live[1][0]["loss"]  # policy == reference at step 1


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("train.objective=dpo", "train.reference=cached"), "train.reference=cached"),
        (("train.objective=dpo", "method.name=lora", "train.reference=cached"), "auto"),
    ],
)
def test_cached_is_refused_for_adapter_methods(
    tiny_llama_dir: Path, tmp_path: Path, overrides: tuple[str, ...], says: str
) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    with pytest.raises(ConfigError, match=says):
        check_config(make_config(tiny_llama_dir, data, tmp_path / "run", *overrides))


def test_the_reference_setting_is_checked_and_recorded(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    pref = ("train.objective=dpo", "data.format=preference")
    live = make_config(tiny_llama_dir, data, tmp_path / "a", *pref, "train.reference=live")
    assert check_config(live) == []  # lora's reference is live already: nothing to say
    assert trajectory_settings(live)["train.reference"] == "live"
    full = make_config(tiny_llama_dir, data, tmp_path / "b", *pref, "method.name=full")
    assert trajectory_settings(full)["train.reference"] == "auto"
    simpo = make_config(
        tiny_llama_dir, data, tmp_path / "c", "train.objective=simpo", "train.reference=live"
    )
    assert any("uses no reference" in w for w in check_config(simpo))
    sft = trajectory_settings(make_config(tiny_llama_dir, data, tmp_path / "d"))
    assert "train.reference" not in sft
