"""`export_model`: load the source, write one format, reload it from disk and check parity.

`FORMATS` is the one registry of export formats: a writer, a loader that reads the written files
back the way a user would, and the parity thresholds of each variant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from leantune.core.writes import check_target, replacing_dir
from leantune.data.formats import read_jsonl
from leantune.export.adapter import load_adapter, write_adapter
from leantune.export.gguf_file import (
    GGUF_TYPES,
    check_gguf_source,
    check_gguf_tokenizer,
    load_gguf,
    write_gguf,
)
from leantune.export.hf import load_hf, write_hf
from leantune.export.int8 import load_int8, write_int8
from leantune.export.parity import (
    REPORT_NAME,
    LogitsFn,
    ParityError,
    Samples,
    Thresholds,
    build_samples,
    check_and_report,
    compare,
    detect_format,
    sample_logits,
)
from leantune.export.source import (
    ExportError,
    ExportSource,
    load_source,
    merge_into_base,
    resolve_export_input,
)
from leantune.export.source import model_logits_fn as _model_logits_fn
from leantune.export.torchscript import example_input, load_torchscript, write_torchscript
from leantune.methods.artifacts import model_config_and_tokenizer
from leantune.models.attention import AttnImplementation
from leantune.models.paths import check_model_path, is_adapter_dir


@dataclass
class ExportJob:
    """Everything a format writer may need; the merged model is built on first use."""

    source: ExportSource
    out: Path
    samples: Samples
    gguf_type: str
    name: str = "model"
    """The export's name (`--out`'s folder name; `out` may be a temporary stand-in)."""
    merge_info: dict[str, Any] = field(default_factory=dict)
    _merged: PreTrainedModel | None = None

    def merged(self) -> PreTrainedModel:
        """The source with adapters folded in (consumes the source model)."""
        # On first use only: the adapter format never merges, and merging consumes the source
        # model, so it can happen once at most.
        if self._merged is None:
            self._merged, self.merge_info = merge_into_base(
                self.source.model, self.source.adapter_dir
            )
        return self._merged

    def example(self) -> torch.Tensor:
        """The example input a trace is made with."""
        return example_input(self.samples.ids[0])


@dataclass(frozen=True)
class ExportFormat:
    """How to write a format, how to read it back, and its parity limits per variant."""

    write: Callable[[ExportJob], dict[str, Any]]
    load: Callable[[Path], LogitsFn]
    thresholds: dict[str, Thresholds]
    """By variant (the GGUF type); "" for formats without variants."""


# Float32 formats must reproduce the source up to summation order. Reduced-precision and quantised
# formats get limits from SmolLM2-135M on 4 demo held-out samples, with headroom: GGUF f16 measured
# max |dlogit| 0.039 and ppl change 1e-5, bf16 (LoRA-merged) 0.25 and 0.0031, q8_0 1.17 and 0.0046.
FORMATS: dict[str, ExportFormat] = {
    "hf": ExportFormat(
        # The merge folds the adapter into W in float32: only rounding separates the two.
        write=lambda j: write_hf(j.merged(), j.source.tokenizer, j.out),
        load=load_hf,
        thresholds={"": Thresholds(max_abs_logit_diff=1e-3, max_ppl_rel_change=1e-4)},
    ),
    "adapter": ExportFormat(
        write=lambda j: write_adapter(j.source.adapter_dir, j.out),
        load=load_adapter,
        # The same base and adapter files, reloaded the same way: nothing should differ.
        thresholds={"": Thresholds(max_abs_logit_diff=1e-5, max_ppl_rel_change=1e-6)},
    ),
    "gguf": ExportFormat(
        write=lambda j: write_gguf(j.merged(), j.source.tokenizer, j.out, j.gguf_type, j.name),
        load=load_gguf,
        thresholds={
            "f16": Thresholds(max_abs_logit_diff=0.25, max_ppl_rel_change=0.005),
            "bf16": Thresholds(max_abs_logit_diff=1.0, max_ppl_rel_change=0.01),
            "q8_0": Thresholds(max_abs_logit_diff=2.5, max_ppl_rel_change=0.02),
        },
    ),
    "torchscript": ExportFormat(
        write=lambda j: write_torchscript(j.merged(), j.source.tokenizer, j.out, j.example()),
        load=load_torchscript,
        thresholds={"": Thresholds(max_abs_logit_diff=1e-3, max_ppl_rel_change=1e-4)},
    ),
    "int8": ExportFormat(
        write=lambda j: write_int8(
            j.merged(), j.source.tokenizer, j.out, j.example(), torch.tensor([j.samples.ids[0]])
        ),
        load=load_int8,
        # Dynamic activation quantisation moves single logits by up to ~22 on SmolLM2-135M
        # (perplexity +10.6%), so perplexity is the real gate and the logit limit only catches
        # a broken model.
        thresholds={"": Thresholds(max_abs_logit_diff=40.0, max_ppl_rel_change=0.15)},
    ),
}


def _check_out(out: Path, source: str) -> None:
    """Refuse an --out that is a file, a link, overlaps the source, or holds something else."""
    if out.is_file() and not out.is_symlink():
        raise ExportError(f"--out {out}: is a file; give a directory (new, empty or an export)")
    _check_creatable(out)  # names the flag, before check_target's own words for the same case
    check_target(out, folder=True)  # it is replaced whole: never through a link
    src = Path(source).expanduser()
    if src.is_dir():
        # Writing into the model being read would replace files the loaded model may still
        # map from disk.
        if out.resolve() == src.resolve():
            raise ExportError(f"--out {out}: is the model being exported; choose another folder")
        if out.resolve().is_relative_to(src.resolve()):
            raise ExportError(
                f"--out {out}: is inside the model being exported ({source}); choose a folder "
                "outside it"
            )
    if out.is_dir() and any(out.iterdir()) and not (out / REPORT_NAME).is_file():
        raise ExportError(
            f"--out {out}: directory exists and is not an earlier export; "
            "choose an empty or new one"
        )


def _check_data(data: Path | None) -> None:
    if data is None:
        return
    if data.is_dir():
        raise ExportError(f"--data {data}: is a directory; give a JSONL file")
    if not data.is_file():
        raise ExportError(f"--data {data}: no such file")
    fmt = detect_format(data)
    records, _ = read_jsonl(data, fmt)  # build_samples renders them once the tokenizer is loaded
    if not records:
        raise ExportError(f"--data {data}: no valid {fmt} record to check parity on")


def _check_creatable(out: Path) -> None:
    """Refuse an --out below a file: mkdir would fail only after the model had loaded."""
    above = out.absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise ExportError(f"--out {out}: cannot be created (Not a directory): {above} is a file")


def _make_parent(out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"--out {out}: cannot be created ({e.strerror})") from None


def check_export(
    out: Path,
    fmt: str,
    reference: list[torch.Tensor],
    samples: Samples,
    source: ExportSource,
    info: dict[str, Any],
    gguf_type: str = "f16",
    shown: Path | None = None,
) -> dict[str, Any]:
    """Reload the export in `out` and compare it with the source's `reference` logits; the
    messages name `shown` when `out` is a temporary stand-in for it.

    Raises:
        ParityError: over a threshold (the report is written first).
    """
    spec = FORMATS[fmt]
    variant = gguf_type if fmt == "gguf" else ""
    limits = spec.thresholds[variant]
    try:
        loaded = spec.load(out)
    except ParityError as e:  # written, but not loadable: a failed check with its report
        return check_and_report(out, {}, limits, info, [str(e)], shown=shown)
    exported = sample_logits(loaded, samples)
    metrics = compare(reference, exported, samples)
    failures: list[str] = []
    if fmt == "gguf":
        tok_info, failures = check_gguf_tokenizer(out, source.tokenizer, samples)
        info = {**info, **tok_info}
    return check_and_report(out, metrics, limits, info, failures, shown=shown)


def export_model(
    path: str,
    fmt: str,
    out: Path,
    gguf_type: str = "f16",
    data: Path | None = None,
    num_samples: int = 4,
    attn_implementation: AttnImplementation = "auto",
) -> dict[str, Any]:
    """Export `path` (run dir, model dir, adapter dir or demo name) to `out` in format `fmt`,
    then check parity; returns the report written to `out/export_report.json`. The source
    loads with `attn_implementation` (`methods.artifacts.load_for_inference`).

    Raises:
        ExportError: the format cannot be made from this input, or `out`/`data` are unusable
            (before anything is written).
        ModelPathError: `path` is not a model (a run without `final/` says how to finish it).
        ParityError: the written export does not reproduce the source (it is written, with
            its report).
        OutputError: `out` is a link or not a folder, or the disk refused a write; an earlier
            export there is kept whole (each export replaces `out` whole when it is done).
    """
    # Cheap refusals first: loading the source model can take minutes.
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: choose one of {sorted(FORMATS)}")
    if fmt == "gguf" and gguf_type not in GGUF_TYPES:
        raise ExportError(f"--gguf-type {gguf_type!r}: choose one of {sorted(GGUF_TYPES)}")
    if num_samples < 1:
        raise ExportError(f"--samples {num_samples}: the parity check needs at least 1 sample")
    # Every input is checked before the source loads, and the source loaded before --out is
    # created.
    resolved = resolve_export_input(path)
    _check_out(out, resolved)
    _check_creatable(out)
    _check_data(data)
    check_model_path(resolved)
    if fmt == "adapter" and not is_adapter_dir(Path(resolved).expanduser()):
        write_adapter(None, out)  # raises the explanatory error
    if fmt == "gguf":
        # An architecture or tokenizer llama.cpp cannot run as transformers does, before the
        # weights load.
        check_gguf_source(*model_config_and_tokenizer(resolved))
    source = load_source(path, attn_implementation)
    try:
        samples = build_samples(source.tokenizer, data, num_samples)
    except ValueError as e:  # no valid record in --data
        raise ExportError(str(e)) from None
    _make_parent(out)  # only now: a refused or failed load creates no folders
    # Before any writer runs: merging consumes the source model these logits come from.
    reference = sample_logits(_model_logits_fn(source.model), samples)
    failed: ParityError | None = None
    with replacing_dir(out) as tmp:  # written and checked beside `out`, then swapped in
        job = ExportJob(source, tmp, samples, gguf_type, name=out.name)
        written = FORMATS[fmt].write(job)
        info = {
            "format": fmt,
            "source": source.path,
            "samples": len(samples.ids),
            "sample_source": str(data) if data else "built-in prompts",
            **({"gguf_type": gguf_type} if fmt == "gguf" else {}),
            **job.merge_info,
            **written,
        }
        try:
            report = check_export(tmp, fmt, reference, samples, source, info, gguf_type, out)
        except ParityError as e:  # the export stays, with its report, for inspection
            failed = e
    # Raised after the block, so that replacing_dir swaps the failed export in (with its report)
    # rather than discarding it as it would on an exception.
    if failed is not None:
        raise failed
    return report


def format_thresholds() -> dict[str, dict[str, dict[str, float]]]:
    """Every format's thresholds, for documentation and tests."""
    return {
        name: {v: dataclasses.asdict(t) for v, t in spec.thresholds.items()}
        for name, spec in FORMATS.items()
    }
