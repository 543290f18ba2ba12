"""What a model path names, told without loading anything (no torch, no transformers).

A model is the demo name, a local directory holding an HF model (`config.json`), a peft adapter
or a leantune bottleneck adapter, a run directory with a `final/` model, a `.gguf` file, or a hub
id `org/name`. Hub ids are read from the local HF cache only unless the user opts in to downloads
with HF_HUB_OFFLINE=0 (`downloads_allowed`), so a mistyped path fails at once instead of after
minutes of network retries. The commands check their `--model` here before they import the
libraries that load it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from leantune.errors import UserError
from leantune.layout import CHECKPOINT_PREFIX, ModelPaths, RunPaths
from leantune.models.demo_model import DEMO_MODEL_NAMES


class ModelPathError(UserError):
    """A path given as a model is not one, or cannot be loaded; the message names it."""


# Names that end like a file are paths, never hub ids (a hub id names a repository).
PATH_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".onnx", ".json", ".yaml")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def downloads_allowed() -> bool:
    """Whether loading may reach the Hugging Face hub: only when the user opts in by setting
    HF_HUB_OFFLINE=0 (or false/no/off) explicitly."""
    # Unset means offline, unlike huggingface_hub's own default: a mistyped path then fails at
    # once instead of after minutes of network retries.
    value = os.environ.get("HF_HUB_OFFLINE")
    return value is not None and value.strip().lower() in ("0", "false", "no", "off")


@contextmanager
def hub_offline_unless_allowed() -> Iterator[None]:
    """Put huggingface_hub in offline mode for the block, unless `downloads_allowed()`."""
    from huggingface_hub import constants

    if downloads_allowed():
        yield
        return
    # The module constant, not only `local_files_only`: transformers 5 looks for an adapter
    # config without it, and huggingface_hub fetches its user-agent registry, each with
    # network retries. The constant is read at call time, so setting it here takes effect.
    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def looks_like_hub_id(path: str) -> bool:
    """`org/name`: one slash and no other separator, not starting with `.`, `~` or `/`, and not
    ending like a file (`.gguf`, `.safetensors`, ...). Anything else is a local path."""
    return (
        _HUB_ID.fullmatch(path) is not None
        and ".." not in path  # `a/..` is a relative path the regex would let through
        and not path.lower().endswith(PATH_SUFFIXES)
    )


def hub_snapshot(repo_id: str, filename: str = ModelPaths.config) -> Path | None:
    """The local HF cache's snapshot directory of `repo_id` if it holds `filename`, else None.

    Reads only the cache directory, never the network.
    """
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename)
    except ValueError:  # huggingface_hub refuses the name as a repo id
        return None
    if not isinstance(found, str):  # None (not cached) or a sentinel (known to be missing)
        return None
    # Up as many levels as `filename` has parts: the snapshot folder that holds it.
    return Path(found).parents[len(Path(filename).parts) - 1]


def missing_path_message(path: str, where: str) -> str:
    """A local path that does not exist: say so, with the closest names in its folder."""
    import difflib  # only on this error path

    p = Path(path).expanduser()
    hint = ""
    try:
        if p.parent.is_dir():
            near = difflib.get_close_matches(p.name, [c.name for c in p.parent.iterdir()], n=3)
            names = ", ".join(str(p.parent / n) for n in near)
            hint = f" (did you mean {names}?)" if near else ""
    except OSError:  # an unreadable folder gives no hint
        pass
    return (
        f"{where}: no such file or directory{hint}; give a model directory, a .gguf file, a hub "
        f"id 'org/name' in the HF cache or '{sorted(DEMO_MODEL_NAMES)[0]}'"
    )


def file_given_message(p: Path, where: str) -> str:
    """A file given where a model is expected (not a .gguf): the folder to give instead when
    it holds the model (`DIR/model.safetensors` is a file of the model `DIR`)."""
    if _holds_model(p.parent):
        return (
            f"{where}: a file of the model directory {p.parent}; a model is loaded from its "
            f"directory (config, weights and tokenizer together): give the directory: {p.parent}"
        )
    return f"{where}: a file that is not a .gguf model; give a .gguf file or a model directory"


def hub_id_problem(path: str, where: str, filename: str = ModelPaths.config) -> str | None:
    """None when the hub id `path` can load (in the HF cache, or `downloads_allowed()`), else
    why not: a missing local path when its first part is a local folder (`runs/dmeo` beside
    `runs/`), otherwise a hub id that is not in the cache."""
    if downloads_allowed() or hub_snapshot(path, filename) is not None:
        return None
    # `runs/dmeo` looks like a hub id, but `runs/` beside it says it is a mistyped local path.
    if Path(path.split("/")[0]).is_dir():
        return missing_path_message(path, where)
    from huggingface_hub import constants

    return (
        f"{where}: not a local path, and not in the HF cache ({constants.HF_HUB_CACHE}). For a "
        "local model give its directory (a typo?); a hub model is read from the cache only: "
        f"download it first (`hf download {path}`), or set HF_HUB_OFFLINE=0 to let leantune "
        "download it"
    )


# Weights in torch's pickle format: loading one runs whatever code it holds, so leantune never
# does (torch.load(weights_only=True) narrows that, and then advises weights_only=False).
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
CONVERT_MODEL = (
    'python -c "import sys, transformers as t; d, o = sys.argv[1:]; '
    "t.AutoModelForCausalLM.from_pretrained(d).save_pretrained(o); "
    't.AutoTokenizer.from_pretrained(d).save_pretrained(o)" {src} {out}'
)
CONVERT_ADAPTER = (
    'python -c "import torch; from safetensors.torch import save_file; '
    "save_file(torch.load('{src}', weights_only=True), '{out}')\""
)


class PickledWeights(ModelPathError):
    """A model or adapter directory whose weights are pickles only (no .safetensors)."""


def refuse_pickled_weights(directory: Path) -> None:
    """Refuse a model or adapter directory that holds pickled weights and no safetensors.

    Raises:
        PickledWeights: naming the file, why it is not loaded and the command that converts it.
    """
    try:
        # Pickles beside safetensors are left alone: the loaders pick safetensors (and are
        # told to: use_safetensors=True), so the pickles are never opened.
        if not directory.is_dir() or any(directory.glob("*.safetensors")):
            return
        pickles = sorted(f for pattern in PICKLED_WEIGHTS for f in directory.glob(pattern))
    except OSError:  # an unreadable folder: the loader says so
        return
    if not pickles:
        return
    found = pickles[0]
    if is_adapter_dir(directory):
        convert = CONVERT_ADAPTER.format(src=found, out=ModelPaths(directory).adapter_weights)
    else:
        convert = CONVERT_MODEL.format(src=directory, out=f"{directory}-safetensors")
    raise PickledWeights(
        f"{directory}: {found.name}: weights in torch's pickle format, and leantune loads only "
        "safetensors: unpickling a file runs any code it holds, so leantune never does. "
        f"Convert it once, on a machine where you trust the file, then use the result: {convert}"
    )


def is_adapter_dir(path: Path) -> bool:
    """True for a peft adapter directory."""
    return ModelPaths(path).adapter_config.is_file()


def is_bottleneck_adapter_dir(path: Path) -> bool:
    """True for a directory written by `methods.adapter.save_adapter`."""
    return ModelPaths(path).bottleneck_config.is_file()


def _is_run_dir(p: Path) -> bool:
    """True for a leantune run directory (it holds the resolved config or checkpoints)."""
    return RunPaths(p).config.is_file() or RunPaths(p).checkpoints.is_dir()


def unfinished_run_message(run: Path) -> str:
    """Why a run directory without `final/` has no model, and how to get one."""
    paths = RunPaths(run)
    steps = sorted(c.name for c in paths.checkpoints.glob(f"{CHECKPOINT_PREFIX}*") if c.is_dir())
    newest = f"newest checkpoint: {steps[-1]}" if steps else "no checkpoint saved yet"
    return (
        f"a leantune run without a final model ({newest}): final/ is written when training "
        "finishes. Run the same `leantune train` command again; it resumes from the newest "
        f"checkpoint and writes {paths.final}. Checkpoints hold what resuming needs "
        "(trainable weights, optimizer state), not a model to load"
    )


def _holds_model(p: Path) -> bool:
    return ModelPaths(p).config.is_file() or is_adapter_dir(p) or is_bottleneck_adapter_dir(p)


def model_of_run(path: str) -> str:
    """The model a path stands for: a run directory's `final/`, else the path as given.

    A directory that itself holds a model is that model, even with a `final/` inside it.
    """
    p = Path(path).expanduser()
    try:
        # A folder that holds a model is that model first: a `final/` inside it is not looked at.
        if p.is_dir() and not _holds_model(p) and RunPaths(p).final.is_dir():
            return str(RunPaths(p).final)
    except OSError:  # a name the OS refuses; check_model_path says so
        pass
    return path


def check_model_path(path: str, label: str = "") -> None:
    """Refuse, before anything loads, a local path that cannot be a model.

    A model is the demo name, a hub id (`org/name`) in the local HF cache (any hub id when
    `downloads_allowed()`), a `.gguf` file, a directory holding an
    HF model (`config.json`), a peft adapter or a bottleneck adapter, or a run directory with a
    `final/` model (see `model_of_run`).

    Raises:
        ModelPathError: naming `label` (e.g. `--model`) and the path, and what to give instead.
    """
    where = f"{label} {path}" if label else path
    if path.lower() in DEMO_MODEL_NAMES:
        return
    p = Path(model_of_run(path)).expanduser()
    try:
        is_file, is_dir = p.is_file(), p.is_dir()
    except (OSError, ValueError) as e:  # a name the OS refuses, e.g. too long
        raise ModelPathError(f"{where}: not a usable path ({e})") from None
    if is_file:
        if p.suffix.lower() != ".gguf":
            raise ModelPathError(file_given_message(p, where))
        return
    if is_dir:
        if _holds_model(p):
            return
        if _is_run_dir(p):
            raise ModelPathError(f"{where}: {unfinished_run_message(p)}")
        ggufs = sorted(p.glob("*.gguf"))
        hint = f"; for its GGUF model give the file, e.g. {ggufs[0]}" if ggufs else ""
        raise ModelPathError(
            f"{where}: not a model directory (no config.json, adapter_config.json or "
            f"leantune adapter){hint}"
        )
    # Checked last: a local path of that shape (already ruled out above) is not a hub id.
    problem = hub_id_problem(path, where) if looks_like_hub_id(path) else None
    if looks_like_hub_id(path) and problem is None:
        return
    raise ModelPathError(problem or missing_path_message(path, where))
