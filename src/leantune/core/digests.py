"""What makes two input files "the same": the sha256 of their bytes, one definition for every
command that reads them (`prepare`'s cache key, a run's fingerprint, an adapter's base model).

Hashing costs seconds per GB, so the digest of a file of 16 MiB or more is cached under
``$LEANTUNE_HOME/hashes`` (`leantune_home`). The cache is keyed by the file's path, device,
inode, size, modification time and status-change time (ctime). Any write to a file sets its
ctime to the current time, and, unlike the modification time, ctime cannot be set back
(``os.utime`` itself sets it to now): a file edited in place and given its old size and mtime
again is hashed again. Two writes within one tick of the file system's clock can leave every
field alike, so the digest of a file changed less than `RECENT_SECONDS` ago is not cached (git
treats its "racily clean" files the same way). A file system that does not keep ctime (some
network and FUSE mounts) leaves only size and mtime to go by.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

from leantune.core.writes import OutputError, write_file
from leantune.layout import ModelPaths


def leantune_home() -> Path:
    """The cache directory: `$LEANTUNE_HOME`, else `~/.cache/leantune`."""
    return Path(os.environ.get("LEANTUNE_HOME", "~/.cache/leantune")).expanduser()


HASH_CACHE_MIN_BYTES = 16 * 2**20
"""Files at least this large have their digest cached (smaller ones hash in milliseconds)."""
RECENT_SECONDS = 2.0
"""A file whose ctime is less than this old is hashed, not cached: the coarsest common file
system clock (ext3, HFS+) ticks once a second."""


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, streamed (no cache)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def content_digest(path: str | Path) -> str:
    """The hex sha256 of the file at `path`, from the cache when it has not changed since.

    Raises:
        OSError: the file cannot be read.
    """
    path = Path(path)
    st = path.stat()
    # Judged before reading: a write that lands during the hash must not be cached under the
    # stat taken here.
    settled = time.time_ns() - st.st_ctime_ns >= RECENT_SECONDS * 1e9
    if st.st_size < HASH_CACHE_MIN_BYTES:
        return sha256_file(path)
    # ctime as well as mtime: any write sets ctime to now, and unlike mtime it cannot be set
    # back, so a file edited in place and given its old size and mtime again is hashed again.
    stat_key = f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}"
    stat_key += f"\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    entry = leantune_home() / "hashes" / f"{hashlib.sha256(stat_key.encode()).hexdigest()}.json"
    try:
        digest = json.loads(entry.read_text(encoding="utf-8"))["sha256"]
        if isinstance(digest, str) and len(digest) == 64:  # a torn or edited entry: hash again
            return digest
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = sha256_file(path)
    if not settled or _changed(path, st):
        return digest  # it may have changed within the same clock tick, or did meanwhile
    with contextlib.suppress(OSError, OutputError):  # a cache not written only costs time
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_file(entry, json.dumps({"path": str(path.resolve()), "sha256": digest}) + "\n")
    return digest


def _changed(path: Path, before: os.stat_result) -> bool:
    after = path.stat()
    return (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
        before.st_size,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )


def local_model_dir(location: str) -> Path | None:
    """The directory holding the model's files: the location itself, or the hub cache's
    snapshot of a hub id (None when it is not cached here)."""
    path = Path(location).expanduser()
    if path.is_dir():
        return path
    try:
        # Imported here: most commands are given a local folder and need no hub client.
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(location, local_files_only=True))
    except Exception:  # not a valid id, not cached: the id itself identifies the model
        return None


def model_files(model_dir: Path, gguf_file: str | None = None) -> list[Path]:
    """A model's files: a GGUF model's one file; else every regular top-level file of the
    directory not starting with a dot (weights, config, tokenizer, chat template)."""
    if gguf_file is not None:
        return [model_dir / gguf_file]
    return sorted(p for p in model_dir.iterdir() if p.is_file() and p.name[0] != ".")


def model_digest(model_dir: Path, gguf_file: str | None = None) -> str:
    """sha256 over the names and contents of `model_files`."""
    h = hashlib.sha256()
    for file in model_files(model_dir, gguf_file):  # sorted: the digest ignores listing order
        # The name too: two files swapping contents is a different model.
        h.update(f"{file.name}\0{content_digest(file)}\n".encode())
    return f"sha256:{h.hexdigest()}"


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json", ".py")
"""The files of a model directory that decide its outputs besides config.json: weights, their
shard index, and model code (trust_remote_code). Tokenizer files are left out: an adapter is
saved with its own tokenizer."""
UNSTABLE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
"""config.json keys that a re-save changes without changing the model."""


def base_model_files(model_dir: Path, gguf_file: str | None = None) -> dict[str, str]:
    """``file name -> sha256`` of what an adapter's outputs depend on in its base model: its
    weights (and their index, and model code) and config.json (read as JSON, without
    `UNSTABLE_CONFIG_KEYS`, so a base saved again by another transformers is the same).

    Raises:
        OSError: a file cannot be read.
    """
    digests: dict[str, str] = {}
    for file in model_files(model_dir, gguf_file):
        if file.name == ModelPaths.config:
            digests[file.name] = _config_digest(file)
        elif file.name.endswith(WEIGHT_SUFFIXES):
            digests[file.name] = content_digest(file)
    return digests


def _config_digest(path: Path) -> str:
    raw = path.read_bytes()
    try:
        config = json.loads(raw)
    except ValueError:  # not JSON: its bytes are all there is to compare
        return hashlib.sha256(raw).hexdigest()
    if isinstance(config, dict):
        for key in UNSTABLE_CONFIG_KEYS:
            config.pop(key, None)
    # Re-serialized with sorted keys: a re-save that only reorders or reindents is the same.
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
