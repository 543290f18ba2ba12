"""The fingerprint of a run: everything that decides its trajectory, as flat ``section.field`` keys.

Two runs with the same fingerprint compute the same steps. Which config fields are in it is each
field's `config.roles.Role`, declared on the field (`config.schema.field_roles`): the
``setting``, ``refused`` and (for a preference objective) ``objective`` fields are recorded
under their own keys, as the run resolved them (``train.lr`` unset is the method's default,
``method.init=auto`` the method's start; ``data.max_seq_len``, ``data.pack`` and
``train.max_steps`` come from the data and method, ``training.run_setup``; ``train.precision``
is the one the run trains in); the ``batch`` fields as the ``train.global_batch`` they make;
the ``content`` fields by the digests of what they name.
``free`` fields are not in it.

Every input the run reads is in it by content: the model directory's files (weights, config,
tokenizer files and chat template: ``model.files``), the train data (``data.train``) and the Jinja
file ``data.chat_template`` names (``data.chat_template_text``, the digest of the template's text;
a built-in's too). Digests are `leantune.core.digests.content_digest`, the definition `prepare` uses
too, cached for large files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from leantune.config import (
    DataConfig,
    MethodConfig,
    ModelConfig,
    TrainConfig,
    configured_global_batch,
    field_roles,
)
from leantune.config.preference import PreferenceConfig
from leantune.config.roles import RECORDED, Role
from leantune.core.digests import content_digest, local_model_dir, model_digest
from leantune.data.prepare.pipeline import read_report
from leantune.data.templates import is_builtin, template_text
from leantune.layout import ModelPaths
from leantune.methods.registry import DEFAULT_LR, resolved_init

CONTENT_KEYS = {
    "model.path": "model.files",
    "model.gguf_file": "model.files",
    "data.train": "data.train",
}
"""The `Role.CONTENT` fields -> the fingerprint key that holds the digest of what they name."""
BATCH_KEY = "train.global_batch"
"""The fingerprint key of the global batch the `Role.BATCH` fields make."""
RESOLVED_LR = "train.lr"
"""Recorded as the method's default LR when unset."""
RESOLVED_INIT = "method.init"
"""Recorded as what it resolves to: auto as the method's own start (`resolved_init`)."""


class RecordedSections(Protocol):
    """The config sections a fingerprint reads (`Config` is one): every field of the others
    (run, guard, monitor, dist) is `Role.FREE`."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def method(self) -> MethodConfig: ...
    @property
    def train(self) -> TrainConfig: ...
    @property
    def preference(self) -> PreferenceConfig: ...


# The config.json keys that decide the shapes of a model's weights.
ARCHITECTURE_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
TEMPLATE_KEY = "data.chat_template_text"
"""The digest of the chat template's text (present only with data.chat_template set)."""
HASHED_KEYS = ("model.files", "data.train", TEMPLATE_KEY)
"""Fingerprint keys whose values are content digests, reported with the file they came from."""


@dataclass(frozen=True)
class Fingerprint:
    """A run's fingerprint and, for the digests in it, where each input was read."""

    fields: dict[str, Any]
    """``section.field`` -> JSON value; two runs match when these are equal."""
    sources: dict[str, str]
    """``model.files`` / ``data.train`` -> the path that was hashed (not compared)."""


@dataclass(frozen=True)
class Change:
    """One fingerprint field that differs between a recorded run and a config."""

    key: str
    old: Any
    new: Any

    def describe(self, old_sources: dict[str, str], new_sources: dict[str, str]) -> str:
        """``key: old -> new``, digests shown with the file they were read from."""
        if self.key in HASHED_KEYS:
            old = _hashed(self.old, old_sources.get(self.key))
            new = _hashed(self.new, new_sources.get(self.key))
            return f"{self.key}: {old} -> {new}"
        return f"{self.key}: {format_value(self.old)} -> {format_value(self.new)}"


def format_value(value: Any) -> str:
    """A config value as a user would type it (null, true, 0.005, [a, b])."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _hashed(value: Any, source: str | None) -> str:
    if not isinstance(value, str) or source is None:
        return format_value(value)
    kind, _, digest = value.partition(":")
    # 12 hex digits tell two files apart in a message; the record keeps the whole digest.
    return f"{Path(source).name} ({kind} {digest[:12]})"


def trajectory_settings(cfg: RecordedSections) -> dict[str, Any]:
    """The fingerprint fields that come from the config alone (no file is read), in the
    schema's order."""
    t = cfg.train
    preference = t.objective != "sft"  # absent for sft: the runs recorded before keep their names
    fields: dict[str, Any] = {}
    for key, role in field_roles().items():
        if role not in RECORDED or (role is Role.OBJECTIVE and not preference):
            continue
        section, name = key.split(".")
        fields[key] = _plain(getattr(getattr(cfg, section), name))
    # The LR the run uses: an unset lr and the same value set explicitly are the same run.
    if fields[RESOLVED_LR] is None:
        fields[RESOLVED_LR] = DEFAULT_LR[cfg.method.name]
    # Likewise the start: auto and what it resolves to are the same run.
    fields[RESOLVED_INIT] = resolved_init(cfg.method)
    # Only the global batch: its split into micro-batches changes the result by float rounding
    # only, and an OOM recovery changes the split itself, which must not block a resume.
    fields[BATCH_KEY] = configured_global_batch(t)
    return fields


def _plain(value: Any) -> Any:
    """Dataclasses and tuples as JSON values, so a recorded fingerprint compares equal."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def run_fingerprint(
    cfg: RecordedSections, model_location: str, gguf_file: str | None
) -> Fingerprint:
    """The full fingerprint: config settings plus the digests of the model and train data.

    Args:
        cfg: The run's validated config (``data.train`` set).
        model_location: The resolved model: a local directory, or a hub id.
        gguf_file: The GGUF file inside ``model_location``, if the model is one.
    """
    assert cfg.data.train is not None
    fields = trajectory_settings(cfg)
    sources: dict[str, str] = {}
    model_dir = local_model_dir(model_location)
    if model_dir is None:
        # Nothing local to hash yet: the hub id stands in for the content.
        fields["model.files"] = f"hub:{model_location}"
        fields["model.architecture"] = None
    else:
        fields["model.files"] = model_digest(model_dir, gguf_file)
        fields["model.architecture"] = architecture(ModelPaths(model_dir).config)
        # Absolute, so the record names the file wherever the next command is run from.
        sources["model.files"] = str(model_dir.resolve())
    data = Path(cfg.data.train)
    fields["data.train"] = data_digest(data)
    sources["data.train"] = str(data.resolve())
    spec = cfg.data.chat_template
    if spec is not None:  # absent otherwise: a run without one keeps its name (run_setup)
        # Hash the text, not the path: an edited template file changes what the run renders.
        text = template_text(spec)
        fields[TEMPLATE_KEY] = f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"
        if not is_builtin(spec):  # a built-in has no file to point the user at
            sources[TEMPLATE_KEY] = str(Path(spec).expanduser().resolve())
    return Fingerprint(fields, sources)


ADDED_FIELDS: dict[str, Any] = {
    # Runs recorded before data.system_message rendered system messages as given, which is
    # what auto does wherever the template writes them (a template that refused one made
    # that record a bad line; folding it now changes those records only).
    "data.system_message": "auto",
    # Adapters started as LoRA's own init before method.init existed.
    "method.init": "default",
    "method.loftq_iter": 1,
}
"""Fields added to the fingerprint after runs were recorded, with the value that reads such a
record as what it ran."""
ADDED_DIGESTS = frozenset({TEMPLATE_KEY})
"""Content digests added to the fingerprint after runs were recorded. Nothing says what an
older record's run read, so one missing from a record is not compared; the resume records it."""


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The fields that differ, sorted by key (a field missing on one side counts as null, or,
    missing from an older record, as its `ADDED_FIELDS` value; an `ADDED_DIGESTS` field missing
    from it is not compared)."""
    old = {**{k: v for k, v in ADDED_FIELDS.items() if k not in old}, **old}
    new = {**{k: v for k, v in ADDED_FIELDS.items() if k not in new}, **new}  # a partial one
    # An added digest missing from the old record is unknown, not null: comparing it would
    # refuse every resume of a run recorded before the digest existed.
    keys = sorted((set(old) | set(new)) - (ADDED_DIGESTS - set(old)))
    return [Change(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def architecture(config_json: Path) -> dict[str, Any] | None:
    """The shape-deciding keys of a model's config.json (None without one, e.g. GGUF)."""
    try:
        raw = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        # The model loader reports a broken config.json; the fingerprint just records none.
        return None
    if not isinstance(raw, dict):
        return None
    return {k: _plain(raw[k]) for k in ARCHITECTURE_KEYS if k in raw}


def data_digest(path: Path) -> str:
    """A train file's sha256, or a prepared directory's cache key (it covers its inputs)."""
    if path.is_dir():
        try:
            report = read_report(path) or {}
        except (OSError, ValueError):
            report = {}  # loading it reports what is wrong
        return f"prepared:{report.get('cache_key')}"
    return f"sha256:{content_digest(path)}"
