"""Read a checkpoint's safetensors so that loading never holds two copies of the weights.

`from_pretrained` memory-maps every shard and keeps all of them open until the last weight is
loaded. Every page it reads stays resident in the process (RSS) while mapped, so a model built
at another dtype than its files (a bf16 checkpoint trained in fp32) or quantised from them
(QLoRA) holds the whole checkpoint's pages beside the weights made from them: a 13 GB bf16 7B
loaded for QLoRA peaked at 18.9 GiB, a 1.4B's bf16 files loaded as fp32 at 8.1 GiB
(benchmarks/results/scale-cpu.json).

Here each tensor is read with `pread` (safetensors' "pread" backend) only when transformers
materialises it, into a buffer that the conversion frees: the peak is the weights plus one
tensor, and the checkpoint stays in the kernel's page cache, which is not the process's memory
and is given back under pressure. The tensors go to `from_pretrained(state_dict=...)` of the
model's own class, so key renames, tied weights, quantisation and the load report are
transformers' own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from safetensors import safe_open

from leantune.layout import ModelPaths


def checkpoint_shards(location: str) -> list[Path] | None:
    """The safetensors files `from_pretrained` would read from the folder `location`, in the
    same way (the index's shards, else model.safetensors); None when it would read none."""
    folder = Path(location)
    files = ModelPaths(folder)
    if files.weights_index.is_file():
        weight_map = json.loads(files.weights_index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))  # each shard once, though it holds many tensors
        shards = [folder / n for n in names]
        # A missing shard: None, so that transformers reads the folder and reports it itself.
        return shards if shards and all(s.is_file() for s in shards) else None
    if files.weights.is_file():
        return [files.weights]
    return None


class LazyStateDict(dict[str, Any]):
    """Tensor name -> a safetensors slice that reads the tensor when indexed.

    `from_pretrained` deep-copies its keyword arguments; the slices (file handles) cannot be
    copied and need not be: this dict is only read, so a copy is the dict itself.
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> LazyStateDict:
        return self


@contextmanager
def pread_state_dict(shards: list[Path]) -> Iterator[LazyStateDict]:
    """Every tensor of `shards`, read on demand by pread; the files are closed on exit."""
    with ExitStack() as stack:
        tensors = LazyStateDict()
        for shard in shards:
            # pread, not mmap: each tensor is read into a buffer the conversion frees, so the
            # checkpoint's pages stay in the page cache, not in this process's RSS.
            handle = stack.enter_context(
                safe_open(str(shard), framework="pt", device="cpu", backend="pread")
            )
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                tensors[name] = handle.get_slice(name)  # a slice reads nothing until indexed
        # The handles stay open until loading ends: transformers indexes the slices lazily.
        yield tensors
