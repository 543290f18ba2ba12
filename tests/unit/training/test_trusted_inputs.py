"""The inputs a run or an adapter reads are identified by their contents, however they change:
a chat template file edited between a run and its resume, a large data file edited in place
with its size and modification time put back, an adapter's base model replaced."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from support import CHATML_TEMPLATE, chat_rows, make_config, run_cli, save_tiny_model, write_jsonl
from transformers import AutoModelForCausalLM

from leantune.core import digests
from leantune.data.prepare.pipeline import cache_key
from leantune.data.prepare.records import PrepareSettings
from leantune.errors import UserError
from leantune.methods.artifacts import load_for_inference, save_final
from leantune.training import recipe
from leantune.training.run import fingerprint
from leantune.training.run.fingerprint import data_digest
from leantune.training.run.resume import RunMismatch

IDS = torch.tensor([[5, 17, 42, 7, 99, 3]])


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------
# data.chat_template: the file's contents, not only its path


def test_an_edited_chat_template_file_refuses_the_resume_and_an_older_record_does_not(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(CHATML_TEMPLATE, encoding="utf-8")
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(8))
    run = tmp_path / "run"

    def train() -> None:
        cfg = make_config(
            tiny_llama_dir, data, run, f"data.chat_template={template}", "data.pack=false",
            "train.max_steps=2", "method.name=lora",
        )  # fmt: skip
        recipe.train(cfg, log=lambda _: None)

    train()
    before = _snapshot(run)
    # Another rendering of the same conversations: the system turn's header changes.
    edited = CHATML_TEMPLATE.replace("'\n'", "'\n\n'")
    assert edited != CHATML_TEMPLATE
    template.write_text(edited, encoding="utf-8")
    with pytest.raises(RunMismatch) as refused:
        train()
    message = str(refused.value)
    assert "data.chat_template_text: chat.jinja (sha256 " in message, message
    assert _snapshot(run) == before  # refused before anything was written

    # A record written before the template's contents were recorded: not refused (nothing
    # says which template it read), and the resume records it from then on.
    record_file = run / "leantune_run.json"
    record = json.loads(record_file.read_text())
    del record["fingerprint"]["data.chat_template_text"]
    record_file.write_text(json.dumps(record))
    train()
    resumed = json.loads(record_file.read_text())["fingerprint"]
    digest = hashlib.sha256(template.read_bytes()).hexdigest()
    assert resumed["data.chat_template_text"] == f"sha256:{digest}"


def test_every_file_of_the_model_directory_is_in_the_fingerprint(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Tokenizer files, config and weights: each edit changes model.files."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    data = write_jsonl(tmp_path / "train.jsonl", chat_rows(2))
    cfg = make_config(model, data, tmp_path / "run")
    seen = {fingerprint.run_fingerprint(cfg, str(model), None).fields["model.files"]}
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"):
        with (model / name).open("ab") as f:
            f.write(b" ")
        seen.add(fingerprint.run_fingerprint(cfg, str(model), None).fields["model.files"])
    assert len(seen) == 5


# ---------------------------------------------------------------------------------------------
# One definition of "the same data": a large file edited in place


def _big_jsonl(path: Path) -> Path:
    """A JSONL file of at least 16 MiB (the size from which digests are cached), written fast."""
    line = json.dumps({"text": "x" * 1000}) + "\n"
    count = digests.HASH_CACHE_MIN_BYTES // len(line) + 1
    path.write_text(line * count, encoding="utf-8")
    return path


def test_a_large_data_file_edited_in_place_is_other_data_for_resume_as_for_prepare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer
) -> None:
    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    # A file changed less than a moment ago is not cached (see the next test): here it is.
    monkeypatch.setattr(digests, "RECENT_SECONDS", 0.0)
    path = _big_jsonl(tmp_path / "big.jsonl")
    settings = PrepareSettings("text", 64, False)
    before, key_before = data_digest(path), cache_key([str(path)], settings, tokenizer)
    st = path.stat()
    time.sleep(0.05)  # past the file system's timestamp tick, as any later edit would be
    with path.open("r+b") as f:
        f.seek(12)
        f.write(b"y")  # the same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same modification time
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)

    now = f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    assert cache_key([str(path)], settings, tokenizer) != key_before  # prepare sees it
    assert data_digest(path) == now != before  # and so does the run's fingerprint


def test_a_file_changed_a_moment_ago_is_hashed_again_until_it_settles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one timestamp tick a second edit leaves every stat field as the first did: a
    digest of a file changed that recently is not kept."""
    monkeypatch.setenv("LEANTUNE_HOME", str(tmp_path / "home"))
    path = _big_jsonl(tmp_path / "big.jsonl")
    assert data_digest(path) == f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    assert not (tmp_path / "home" / "hashes").exists()
    monkeypatch.setattr(digests, "RECENT_SECONDS", 0.0)
    assert data_digest(path) == f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    assert len(list((tmp_path / "home" / "hashes").iterdir())) == 1


# ---------------------------------------------------------------------------------------------
# An adapter and its base


def _lora_final(base: Path, tokenizer, out: Path) -> tuple[Path, torch.Tensor]:
    """A LoRA adapter on `base` with moved weights, saved as `train` saves it; its logits."""
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8),
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)
        expected = model(input_ids=IDS).logits
    return save_final(model, tokenizer, out, str(base)), expected


def test_an_adapter_refuses_a_base_whose_files_were_replaced(
    tokenizer, tokenizer_dir: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    final, expected = _lora_final(base, tokenizer, tmp_path / "final")
    reloaded, _ = load_for_inference(str(final))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=IDS).logits, expected)

    recorded = hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()
    other = save_tiny_model(tmp_path / "other", "llama", tokenizer_dir, seed=1)
    shutil.copy(other / "model.safetensors", base / "model.safetensors")  # same names, shapes
    now = hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()
    with pytest.raises(UserError) as refused:
        load_for_inference(str(final))
    message = str(refused.value)
    assert str(final / "leantune_base.json") in message and str(base) in message, message
    assert f"model.safetensors (sha256 {recorded[:12]} -> {now[:12]})" in message, message

    data = write_jsonl(tmp_path / "eval.jsonl", chat_rows(2))
    for command in (
        ["eval", "--model", str(final), "--data", str(data)],
        ["generate", "--model", str(final), "--prompt", "hi"],
        ["export", str(final), "--format", "hf", "--out", str(tmp_path / "out")],
    ):
        result = run_cli(command)
        assert result.code == 2 and "model.safetensors (sha256" in result.err, result
    assert not (tmp_path / "out").exists()


def test_an_adapter_saved_without_its_base_digest_loads_with_one_warning(
    tokenizer, tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final, expected = _lora_final(tiny_llama_dir, tokenizer, tmp_path / "final")
    pointer = final / "leantune_base.json"
    info = json.loads(pointer.read_text())
    info.pop("base_files", None)  # as a leantune before the digest was recorded wrote it
    pointer.write_text(json.dumps(info))
    capsys.readouterr()
    reloaded, _ = load_for_inference(str(final))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=IDS).logits, expected)
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln.lower()]
    assert len(warned) == 1 and warned[0].startswith("warning: ") and str(pointer) in warned[0]
