"""EleutherAI lm-evaluation-harness (`lm-eval`, optional extra `eval`) on an in-memory model.

The model is handed to the harness's HF backend (`HFLM`) as a loaded object, so any model leantune
can load (a run's adapter, a merged export, a GGUF) is evaluated the same way. Tasks are the
harness's own names; `include_path` adds a directory of custom task YAML files, e.g. a local task
whose data is a JSONL file (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from peft import PeftModel
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from leantune.errors import UserError
from leantune.models.paths import downloads_allowed, hub_offline_unless_allowed


class TaskDataUnavailable(UserError):
    """A task's dataset is neither in the cache nor downloadable (offline)."""


@contextmanager
def _datasets_offline_unless_allowed() -> Iterator[None]:
    """The hub offline for the harness's dataset loads too, unless the user opted in."""
    import datasets.config

    # datasets reads its own copy of HF_HUB_OFFLINE at import, so setting the environment
    # variable is too late; left online, it would retry the network for half a minute first.
    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = saved or not downloads_allowed()
    try:
        with hub_offline_unless_allowed():
            yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved


def run_lm_eval(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    limit: int | None = None,
    include_path: str | None = None,
    include_defaults: bool | None = None,
    batch_size: int = 8,
    log_samples: bool = False,
) -> dict[str, Any]:
    """Run harness `tasks` on `model` and return the harness's output (`results` per task, and
    `samples` when `log_samples`).

    Args:
        model: a loaded causal LM; a peft model is merged first (the harness needs a plain one).
        tokenizer: its tokenizer.
        tasks: harness task names.
        limit: evaluate only the first `limit` documents of each task.
        include_path: a directory of extra task YAML files.
        include_defaults: also index the harness's built-in tasks. None: only when some task is
            not found in `include_path` (indexing the built-in tasks takes about a minute).
        batch_size: documents per forward pass.
        log_samples: keep per-document requests and responses in the output.

    Raises:
        ImportError: lm-eval is not installed, with the command that installs it.
        TaskDataUnavailable: a task's dataset is not cached and downloads are off (exit 2).
    """
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ImportError("--lm-eval needs lm-eval: pip install 'leantune[eval]'") from e
    if isinstance(model, PeftModel):  # HFLM expects a plain transformers model
        model = model.merge_and_unload()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    if include_defaults is None:
        # Indexing the built-in tasks takes about a minute: skip it when include_path has them all.
        include_defaults = include_path is None or not set(tasks) <= set(
            TaskManager(include_path=include_path, include_defaults=False).all_tasks
        )
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    try:
        with _datasets_offline_unless_allowed():
            out = simple_evaluate(
                model=lm, tasks=tasks, limit=limit, task_manager=manager, log_samples=log_samples
            )
    except (ConnectionError, FileNotFoundError) as e:  # offline, and not in the cache
        raise TaskDataUnavailable(
            f"--lm-eval {','.join(tasks)}: a task's dataset cannot be loaded "
            f"({' '.join(str(e).split())}); lm-eval reads its datasets from the Hugging Face "
            "Hub, so it needs the network (leantune stays offline unless HF_HUB_OFFLINE=0 is "
            "set) or the datasets already in the cache (HF_DATASETS_CACHE; a run with "
            "HF_HUB_OFFLINE=0 fills it)"
        ) from None
    if out is None:
        raise RuntimeError("lm-eval returned no results")
    return dict(out)


def summarize(output: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Numeric metrics per task, from the harness output (`acc,none` -> `acc`)."""
    summary: dict[str, dict[str, float]] = {}
    for task, metrics in output.get("results", {}).items():
        summary[task] = {}
        for key, value in metrics.items():
            # bool is an int subclass, but a flag is no metric; strings (alias) are skipped too.
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            # The harness keys metrics "name,filter"; the default filter "none" adds nothing.
            name, _, filter_name = key.partition(",")
            summary[task][name if filter_name in ("", "none") else key] = float(value)
    return summary
