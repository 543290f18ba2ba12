"""Fuzzing every command's inputs ("no traceback, ever"): files that are empty,
binary, cut short, one huge line, JSON of the wrong types, missing or a folder; model folders
with a damaged config, weights or tokenizer; flag values out of range or not numbers; stdin for
`generate --chat`. Each call is `main(argv)` in this process and must end in exit 0 or 2 with
no traceback on either stream: never 1, never 70 (an internal error) and never an exception.

The default suite runs a few fixed examples per command (`derandomize`: the same every run, so
a failure reproduces); `-m slow` runs many more.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from support import run_cli

ROWS = [
    {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
    for i in range(8)
]
CHAT = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
CHATML = (
    b"{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    b"{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG = (
    "model: {path: '{model}'}\n"
    "data: {train: '{data}', eval: null, format: chat, max_seq_len: 64, pack: false}\n"
    "train: {max_steps: 1, micro_batch_size: 2, eval_exact_match: false}\n"
    "run: {dir: '{run}', progress: false}\n"
)
"""A valid config of the tiny model (its `{placeholders}` are filled in by `materialise`)."""
RUN_FILES = {
    "leantune_run.json": b'{"fingerprint": {"train.global_batch": 2}}',
    "config.yaml": b"model: {path: m}\ndata: {train: d.jsonl}\ntrain: {max_steps: 2}\n",
    "metrics.jsonl": b'{"step": 1, "loss": 2.5, "lr": 0.01}\n{"step": 2, "loss": 2.0}\n',
    "summary.json": b'{"steps": 2, "final_train_loss": 2.0}',
    "events.jsonl": b'{"kind": "skip", "step": 1, "message": "x"}\n',
}

# --- what an input file can be ----------------------------------------------------------------

DIR = "<a folder>"
KINDS = (
    "valid",
    "empty",
    "binary",
    "truncated",
    "huge_line",
    "wrong_json_types",
    "not_utf8",
    "bom_crlf",
    "deep",
    "missing",
    "folder",
)
WRONG_JSON = (
    b'[1, 2]\n"text"\n{"messages": "x"}\n{"messages": [{"role": 1, "content": null}]}\n'
    b'{"step": "x", "loss": [], "kind": {}}\n{"instruction": 5, "output": []}\n'
)


def content(kind: str, valid: bytes) -> bytes | str | None:
    """The bytes of a file of `kind` made from `valid`; None: no file; DIR: a folder."""
    return {
        "valid": valid,
        "empty": b"",
        "binary": bytes(range(256)) * 16,
        "truncated": valid[: len(valid) // 2],
        "huge_line": b'{"messages": [{"role": "user", "content": "' + b"x" * 1_000_000,
        "wrong_json_types": WRONG_JSON,
        "not_utf8": valid.replace(b"a", b"\xff\xfe", 2),
        "bom_crlf": b"\xef\xbb\xbf" + valid.replace(b"\n", b"\r\n"),
        "deep": b"[" * 50_000 + b"\n",
        "missing": None,
        "folder": DIR,
    }[kind]


FILE = st.one_of(st.just("valid"), st.sampled_from(KINDS[1:]))
"""The kind of one input file (its valid content is `VALID[slot]`): valid half the time, so that
the other inputs are reached too."""


MODEL_PARTS = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelKind:
    """The tiny model as it is, or with one of its files replaced (or missing, or a folder)."""

    part: str | None = None
    kind: str = "valid"


MODELS = st.one_of(
    st.just(ModelKind()),
    st.builds(ModelKind, st.sampled_from(MODEL_PARTS), st.sampled_from(KINDS[1:])),
)

# --- flag values -------------------------------------------------------------------------------

INTS = ("0", "1", "2", "-1", "3.5", "x", "", "1e3", "99999999999999999999", "\u0663")
FLOATS = ("0", "0.5", "1", "-1", "nan", "inf", "1e-300", "x", "")
TEXTS = (
    "",
    " ",
    "hi",
    "q 1",
    "\u202e\u0000x",
    "a\udc80b",
    "y" * 5000,
    "{{ raise_exception('x') }}",
)
SMALL = ("0", "1", "2", "-1", "x", "")
"""Values of a flag that costs time in proportion (new tokens): no large valid ones."""


def flag(name: str, values: tuple[str, ...]) -> st.SearchStrategy[list[str]]:
    """`[name, value]`, or nothing (the flag left at its default)."""
    return st.one_of(st.just([]), st.sampled_from(values).map(lambda v: [name, v]))


def args(*parts: st.SearchStrategy[list[str]]) -> st.SearchStrategy[list[str]]:
    return st.tuples(*parts).map(lambda xs: [a for x in xs for a in x])


# --- one case: argv with placeholders, the files they name, stdin -----------------------------


@dataclass
class Case:
    argv: list[str]
    files: dict[str, str] = field(default_factory=dict)
    """slot -> the kind of file written for it (see `content`)."""
    model: ModelKind = field(default_factory=ModelKind)
    stdin: str | None = None


def case(
    argv: st.SearchStrategy[list[str]],
    slots: tuple[str, ...] = (),
    model: st.SearchStrategy[ModelKind] | None = None,
    stdin: st.SearchStrategy[str | None] | None = None,
) -> st.SearchStrategy[Case]:
    return st.builds(
        Case,
        argv,
        st.fixed_dictionaries({slot: FILE for slot in slots}),
        model if model is not None else st.just(ModelKind()),
        stdin if stdin is not None else st.none(),
    )


def _model_dir(tiny: Path, where: Path, kind: ModelKind) -> Path:
    if kind.part is None:
        return tiny
    out = where / "model"
    shutil.copytree(tiny, out)
    _write(out / kind.part, content(kind.kind, (tiny / kind.part).read_bytes()))
    return out


def _write(path: Path, data: bytes | str | None) -> None:
    if path.exists():
        path.unlink()
    if data == DIR:
        path.mkdir()
    elif isinstance(data, bytes):
        path.write_bytes(data)


def materialise(c: Case, tiny: Path, where: Path) -> list[str]:
    """Write the case's files under `where`; its argv with the placeholders filled in."""
    names = {"model": str(_model_dir(tiny, where, c.model)), "run": str(where / "run")}
    names |= {"out": str(where / "out"), "tmp": str(where)}
    names |= {slot: str(where / f"{slot}.{_suffix(slot)}") for slot in c.files}
    for slot, kind in c.files.items():
        data = content(kind, VALID[slot])
        if isinstance(data, bytes):
            data = data.replace(b"{model}", names["model"].encode())
            data = data.replace(b"{data}", names.get("data", "").encode())
            data = data.replace(b"{run}", names["run"].encode())
        _write(Path(names[slot]), data)
    return [a.format(**names) for a in c.argv]


def _suffix(slot: str) -> str:
    return {"config": "yaml", "template": "jinja"}.get(slot, "jsonl")


# --- the commands -----------------------------------------------------------------------------

TRAIN_OVERRIDES = (
    "train.lr=nan",
    "train.lr=-1",
    "data.max_seq_len=1",
    "data.max_seq_len=0",
    "train.micro_batch_size=0",
    "train.max_steps=0",
    "method.name=nope",
    "method.r=0",
    "data.format=text",
    "data.format=alpaca",
    "data.pack=true",
    "data.chat_template={template}",
    "run.dir={data}",
    "x",
    "=",
    "a.b.c=1",
    "train.seed=-1",
    "data.max_bad_fraction=2",
)
OVERRIDES = st.lists(st.sampled_from(TRAIN_OVERRIDES), max_size=2)
VALID = {"data": CHAT, "template": CHATML, "config": CONFIG.encode(), **RUN_FILES}


_TRAIN = [
    "train",
    "model.path={model}",
    "data.train={data}",
    "data.format=chat",
    "data.max_seq_len=64",
    "data.eval=null",
    "train.eval_exact_match=false",
    "train.max_steps=1",
    "train.micro_batch_size=2",
    "run.dir={run}",
    "run.progress=false",
    "monitor.report=false",
]


def _train() -> st.SearchStrategy[Case]:
    argv = args(st.just(_TRAIN), OVERRIDES)
    return case(argv, ("data", "template"), MODELS)


COMMANDS: dict[str, Callable[[], st.SearchStrategy[Case]]] = {
    "train": _train,
    "validate": lambda: case(
        args(st.just(["validate", "{config}"]), OVERRIDES),
        ("config", "data", "template"),
    ),
    "prepare": lambda: case(
        args(
            st.just(["prepare", "--data", "{data}", "--model", "{model}", "--out", "{out}"]),
            flag("--format", ("chat", "text", "alpaca", "sharegpt", "prompt_completion", "x")),
            flag("--max-seq-len", INTS),
            flag("--chat-template", ("{template}", "chatml", "nope")),
            flag("--min-tokens", INTS),
            flag("--near-dup-threshold", FLOATS),
            flag("--clean", ("none", "html,x", "", "html")),
            flag("--system-prompt", TEXTS),
        ),
        ("data", "template"),
        MODELS,
    ),
    "plan": lambda: case(
        args(
            st.just(["plan", "{config}"]),
            flag("--budget", ("24GiB", "0", "-1", "1e400GiB", "x", "", "1KiB")),
            flag("--device", ("cpu", "cuda")),
            st.sampled_from([[], ["--json"]]),
            OVERRIDES,
        ),
        ("config", "data", "template"),
        MODELS,
    ),
    "inspect": lambda: case(
        args(
            st.just(["inspect", "{config}"]),
            flag("-n", INTS),
            flag("--color", ("always", "never", "x")),
            OVERRIDES,
        ),
        ("config", "data", "template"),
        MODELS,
    ),
    "eval": lambda: case(
        args(
            st.just(["eval", "--model", "{model}", "--data", "{data}"]),
            st.sampled_from([["--max-new-tokens", v] for v in SMALL]),
            flag("--format", ("chat", "text", "alpaca")),
            flag("--chat-template", ("{template}", "chatml", "nope")),
            flag("--limit", INTS),
            flag("--batch-size", SMALL),
            flag("--max-seq-len", INTS),
            flag("--dtype", ("fp32", "bf16", "x")),
        ),
        ("data", "template"),
        MODELS,
    ),
    "generate": lambda: case(
        args(
            st.just(["generate", "--model", "{model}"]),
            st.sampled_from([["--max-new-tokens", v] for v in SMALL]),
            st.one_of(flag("--prompt", TEXTS), st.just(["--chat"])),
            flag("--system", TEXTS),
            flag("--chat-template", ("{template}", "chatml", "nope")),
            flag("--temperature", FLOATS),
            flag("--top-p", FLOATS),
            flag("--top-k", INTS),
            flag("--repetition-penalty", FLOATS),
            flag("--seed", INTS),
            st.sampled_from([[], ["--raw"]]),
        ),
        ("template",),
        MODELS,
        st.one_of(st.none(), st.sampled_from(TEXTS).map(lambda t: f"{t}\nq 2\n/exit\n")),
    ),
    "export": lambda: case(
        args(
            st.just(["export", "{model}", "--out", "{out}"]),
            st.sampled_from([["--format", f] for f in ("hf", "adapter", "gguf", "int8", "x")]),
            flag("--data", ("{data}",)),
            flag("--samples", SMALL),
            flag("--gguf-type", ("f16", "q8_0", "x")),
        ),
        ("data",),
        MODELS,
    ),
    "report": lambda: case(
        args(st.just(["report", "{tmp}/run"]), flag("--out", ("{tmp}", "{tmp}/no/such/r.html"))),
        tuple(RUN_FILES),
    ),
    "dashboard": lambda: case(
        args(
            st.sampled_from([["dashboard", "{tmp}"], ["dashboard", "{data}"]]),
            flag("--port", ("0", "-1", "70000", "x", "")),
            flag("--host", ("127.0.0.1", "", "256.1.1.1", "no-such-host.invalid", "::1")),
        ),
        ("data",),
    ),
    "bench methods": lambda: case(
        args(
            st.just(["bench", "methods", "{config}", "--out", "{out}"]),
            # Each method trains: one at a time, one step (every method is bench's own tests').
            st.sampled_from([["--methods", m] for m in ("lora", "ia3", "nope", "", ",", "lora,x")]),
            st.sampled_from([["--steps", s] for s in ("1", "0", "-1", "x")]),
            flag("--lr", ("lora=x", "x", "lora=-1", "=")),
            flag("--grid", ("ia3=x", "x:y")),
        ),
        ("config", "data"),
    ),
    "bench throughput": lambda: case(
        args(
            st.just(["bench", "throughput", "--out", "{out}", "--model", "{model}"]),
            st.sampled_from(
                [[f, v] for f in ("--conversations", "--reps", "--threads") for v in SMALL[3:]]
                + [["--methods", v] for v in ("nope", "", ",")]
            ),
        ),
        (),
        MODELS,
    ),
    # Invalid values only: valid ones would train TRL and leantune (the bench's own tests do).
    "bench preference": lambda: case(
        args(
            st.just(["bench", "preference", "--out", "{out}", "--model", "{model}"]),
            st.sampled_from(
                [[f, v] for f in ("--pairs", "--heldout", "--steps", "--reps") for v in SMALL[3:]]
                + [[f, "x"] for f in ("--beta", "--lr", "--trl-batch")]
                + [["--precision", "fp16"]]
            ),
        ),
        (),
        MODELS,
    ),
}
"""Every command and subcommand of `leantune --help` (a test keeps them in step)."""


REPORT = ["report", "{tmp}/run"]
MODEL_BOM = ModelKind("config.json", "bom_crlf")
FOUND: dict[str, list[Case]] = {
    "train": [
        Case(_TRAIN, {"data": "valid", "template": "valid"}, ModelKind("config.json", "deep"))
    ],
    "report": [
        Case([*REPORT, "--out", "{tmp}"], dict.fromkeys(RUN_FILES, "valid")),
        Case(REPORT, {**dict.fromkeys(RUN_FILES, "valid"), "leantune_run.json": "deep"}),
        Case(REPORT, {**dict.fromkeys(RUN_FILES, "valid"), "config.yaml": "binary"}),
        Case(REPORT, {**dict.fromkeys(RUN_FILES, "valid"), "metrics.jsonl": "binary"}),
    ],
    "bench throughput": [
        Case(["bench", "throughput", "--model", "{model}", "--conversations", "-1"])
    ],
    "bench methods": [
        Case(
            ["bench", "methods", "{config}", "--out", "{out}", "--methods", "lora,lora"],
            {"config": "valid", "data": "empty"},
        )
    ],
    "plan": [Case(["plan", "{config}"], {"config": "valid", "data": "valid"}, MODEL_BOM)],
}
"""Examples the fuzzing found that once ended in a traceback: run first, in every variant."""


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same examples every run: a failure reproduces
        database=None,
        phases=(Phase.explicit, Phase.generate),  # no shrinking: each example is a whole command
    )


QUICK = {"train": 3, "export": 3, "bench methods": 1, "inspect": 4, "validate": 5, "report": 4}
"""Examples per command in the default suite (6 for the others); `-m slow` runs 60 of each."""


def _move_run_files(command: str, where: Path) -> None:
    """For `report`: the run's own files (each fuzzed) into the run directory."""
    if command != "report":
        return
    for name in RUN_FILES:
        moved = where / f"{name}.{_suffix(name)}"
        if moved.exists():
            moved.rename(where / "run" / name)


def _train_in_process(cmd: list[str], log_file: Path) -> tuple[int, str | None]:
    """`bench.methods.run_logged` without the subprocess (4 s of imports per method): the
    fuzzing is of bench's own inputs; train's are fuzzed on their own."""
    done = run_cli(cmd[cmd.index("train") :])
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.write_text(done.out + done.err)
    lines = [x for x in done.err.splitlines() if x.strip()]
    return done.code, None if done.code == 0 else (lines[-1] if lines else str(done.code))


def _fuzz(command: str, examples: int, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The dashboard serves until Ctrl-C: what is fuzzed is everything before it serves.
    monkeypatch.setattr(
        "leantune.monitor.dashboard.server.serve", lambda server: server.server_close()
    )
    monkeypatch.setattr("leantune.bench.methods.run_logged", _train_in_process)

    def one(c: Case) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            where = Path(tmp)
            (where / "run").mkdir()
            argv = materialise(c, tiny, where)
            _move_run_files(command, where)
            with monkeypatch.context() as m:
                m.setattr("sys.stdin", io.StringIO(c.stdin or ""))
                done = run_cli(argv)  # fails on an escaping exception or a traceback
            assert done.code in (0, 2), (argv, done)

    for found in FOUND.get(command, []):
        one = example(found)(one)
    given(COMMANDS[command]())(_settings(examples)(one))()


def test_every_command_is_fuzzed() -> None:
    from leantune.cli.app import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = set(sub.choices) - {"bench"}  # type: ignore[union-attr]
    bench = sub.choices["bench"]  # type: ignore[index]
    bench_sub = next(a for a in bench._actions if a.dest and a.choices)
    names |= {f"bench {n}" for n in bench_sub.choices}  # type: ignore[union-attr]
    assert names == set(COMMANDS)


def _valid(argv: list[str], *slots: str) -> Case:
    return Case(argv, dict.fromkeys(slots, "valid"))


BASELINE: dict[str, Case] = {
    "train": _valid(_TRAIN, "data"),
    "validate": _valid(["validate", "{config}"], "config", "data"),
    "prepare": _valid(
        ["prepare", "--data", "{data}", "--model", "{model}", "--out", "{out}", "--format", "chat"],
        "data",
    ),
    "plan": _valid(["plan", "{config}"], "config", "data"),
    "inspect": _valid(["inspect", "{config}"], "config", "data"),
    "eval": _valid(
        ["eval", "--model", "{model}", "--data", "{data}", "--max-new-tokens", "2"], "data"
    ),
    "generate": _valid(
        ["generate", "--model", "{model}", "--prompt", "hi", "--max-new-tokens", "2"]
    ),
    "export": _valid(["export", "{model}", "--out", "{out}", "--format", "hf"]),
    "report": _valid(REPORT, *RUN_FILES),
    "dashboard": _valid(["dashboard", "{tmp}", "--port", "0"]),
    "bench methods": _valid(
        ["bench", "methods", "{config}", "--out", "{out}", "--methods", "lora", "--steps", "1"],
        "config",
        "data",
    ),
}
"""One call per command with every input valid: it succeeds, so the fuzzing reaches the
command itself (bench methods, 8 s, only with -m slow; bench throughput, which trains HF Trainer
as well, not here)."""


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(c, marks=[pytest.mark.slow] if c == "bench methods" else [])
        for c in sorted(BASELINE)
    ],
)
def test_the_fuzzed_command_succeeds_on_valid_inputs(
    command: str, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "leantune.monitor.dashboard.server.serve", lambda server: server.server_close()
    )
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        (where / "run").mkdir()
        argv = materialise(BASELINE[command], tiny_qwen2_dir, where)
        _move_run_files(command, where)
        done = run_cli(argv)
        assert done.code == 0, (argv, done)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_fuzz_command_exits_0_or_2_without_a_traceback(
    command: str, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fuzz(command, QUICK.get(command, 6), tiny_qwen2_dir, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_fuzz_command_many_examples(
    command: str, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fuzz(command, 60, tiny_qwen2_dir, monkeypatch)
