"""The `data` section as `leantune prepare` and `train` use it: typed settings for the pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leantune.config import DataConfig

if TYPE_CHECKING:  # records imports transformers; `leantune --help` should not wait for it
    from leantune.data.prepare.records import PrepareSettings  # transformers: see above


PREPARE_MAX_SEQ_LEN = 1024
"""Row length of `leantune prepare` with data.max_seq_len=auto: it packs while it streams, so
it needs the length before it has seen the data (`train` finds it from the data instead)."""


def settings_from_config(data: DataConfig) -> PrepareSettings:
    """PrepareSettings from a `DataConfig` (the `data` section); auto values as prepare uses
    them (max_seq_len 1024, packing on)."""
    from leantune.data.prepare.records import PrepareSettings  # transformers: see above

    return PrepareSettings(
        format=data.format,
        max_seq_len=PREPARE_MAX_SEQ_LEN if data.max_seq_len == "auto" else data.max_seq_len,
        pack=data.pack is not False,  # "auto" packs: only an explicit false does not
        system_prompt=data.system_prompt,
        system_message=data.system_message,
        clean=tuple(data.clean),
        dedup=data.dedup,
        near_dup_threshold=data.near_dup_threshold,
        min_tokens=data.min_tokens,
        truncate=data.truncate,
    )


def engine_options(data: DataConfig) -> dict[str, Any]:
    """Engine keyword arguments of `prepare_dataset` from a `DataConfig`."""
    return {"engine": data.engine, "scheduler": data.scheduler, "partition_mb": data.partition_mb}
