"""Shared fixtures: the tiny tokenizer and models (built once per session), the chat files most
training tests use, and the LEANTUNE_* fault hooks. Nothing here touches the network; every
fixture is deterministic. The helpers they are built from, and that test files import, are in
support.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import (
    build_tiny_tokenizer,
    chat_rows,
    save_tiny_model,
    write_jsonl,
)
from transformers import (
    PreTrainedTokenizerFast,
)

from leantune.models.bnb_notice import import_offline
from leantune.testing.faults import install_env_faults

# bitsandbytes' import asks the Hugging Face Hub for an optional kernel when the `kernels`
# package is installed (transformers 5.25 requires it): offline here, as in every leantune
# command (`bnb_notice.import_offline`), so that no test reaches the network through it.
import_offline()


@pytest.fixture(autouse=True, scope="session")
def env_faults() -> None:
    """The LEANTUNE_* fault hooks, installed as `leantune`'s entry installs them: tests that
    call the recipe in-process set those variables and expect what the command line would do."""
    install_env_faults()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tokenizer_dir)


@pytest.fixture()
def chat_files(tmp_path: Path) -> tuple[Path, Path]:
    """(train.jsonl with 24 chats, eval.jsonl with 4 others) under the test's tmp_path."""
    return (
        write_jsonl(tmp_path / "train.jsonl", chat_rows(24)),
        write_jsonl(tmp_path / "eval.jsonl", chat_rows(4, offset=100)),
    )
