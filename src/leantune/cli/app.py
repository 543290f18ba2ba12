"""Command line: a thin layer over the library.

leantune train [CONFIG.yaml] [--metrics-port N] [section.key=value ...]
leantune validate CONFIG.yaml [section.key=value ...] | --help-fields
leantune prepare CONFIG.yaml | --data FILE... --format F --model PATH [--out DIR] [--engine dask]
leantune plan [CONFIG.yaml] [--budget 24GiB] [--device cpu|cuda] [--json] [section.key=value ...]
leantune inspect [CONFIG.yaml] [section.key=value ...] [-n N] [--color auto|always|never]
leantune eval --model MODEL_OR_RUN --data FILE [--limit N] [--lm-eval TASKS [--lm-eval-limit N]]
leantune generate --model MODEL_OR_RUN --prompt TEXT [--chat] [sampling options]
leantune bench methods [CONFIG.yaml] [--methods a,b] [--out DIR] [section.key=value ...]
leantune bench throughput [--conversations N] [--reps N] [--methods lora,full]
leantune bench preference [--pairs N] [--steps N] [--reps N] [--model PATH]
leantune export RUN_OR_MODEL --format hf|adapter|gguf|torchscript|int8 --out DIR
leantune dashboard [RUNS_DIR] [--port N] [--host 127.0.0.1]
leantune report RUN_DIR [--out FILE]

Each command group's module (`GROUPS`) adds its parsers and names the function each command
runs; `main` imports that function only when its command runs. Exit codes: `cli.train` (train),
`cli.crash` (70, an internal error, for every command).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from leantune import __version__
from leantune.cli import bench, inference, monitor, prepare, train
from leantune.cli.args import Parser
from leantune.cli.crash import report_internal_error
from leantune.core import writes
from leantune.core.allocator import reexec_with_allocator
from leantune.core.cpu_load import machine_contended
from leantune.core.kernel_caches import bound_kernel_caches
from leantune.core.openmp import set_wait_policy
from leantune.errors import UserError
from leantune.models.quiet import quiet_import_noise
from leantune.testing.faults import install_env_faults
from leantune.training.parallel.launch import launched_by_torchrun, rank_tag

GROUPS = (train, prepare, inference, bench, monitor)
"""The command groups, in the order `leantune --help` lists them; each has `add_parsers(sub)`."""

ALLOCATOR_COMMANDS = frozenset({"train", "eval", "generate", "export", "bench"})
"""The commands that run a model: their own process re-executes itself with tcmalloc when it is
installed (`leantune.core.allocator`; LEANTUNE_ALLOCATOR=system keeps glibc's), and its OpenMP
threads wait passively when the machine is busy at the start (`leantune.core.openmp`)."""


def build_parser() -> argparse.ArgumentParser:
    """The `leantune` parser: every command and its flags (imports no torch)."""
    p = Parser(
        prog="leantune",
        description="Fine-tune text-generation LLMs on the hardware you have. "
        "`leantune COMMAND --help` shows a command's flags and their defaults.",
    )
    p.add_argument("--version", action="version", version=f"leantune {__version__}")
    sub = p.add_subparsers(dest="command", required=True)  # parsers of the same class, Parser
    for group in GROUPS:
        group.add_parsers(sub)
    return p


def command_function(target: str) -> Callable[[argparse.Namespace], int]:
    """The function a command runs, imported from its "module:function" (`cli.args.runs`)."""
    # Imported here, when the command runs, and nowhere else: the command modules import torch,
    # transformers and peft (seconds), which `leantune --help`, an argument error and the other
    # commands do without.
    module, _, name = target.partition(":")
    function: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
    return function


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`argv` parsed; SystemExit on --help or a usage error (argparse has printed it)."""
    # parse_known_args, not parse_args: the leftovers may be overrides (below).
    args, extra = parser.parse_known_args(argv)
    # argparse ends a nargs="*" positional at the first flag: `train cfg.yaml --metrics-port
    # 9100 train.lr=1e-4` leaves the override over; it belongs to the CONFIG/overrides list.
    if extra and (
        not isinstance(getattr(args, "args", None), list) or any(x.startswith("-") for x in extra)
    ):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.args += extra
    return args


def run(args: argparse.Namespace) -> int:
    """Run the parsed command: its checks, then the function it names."""
    if args.own_process and args.command in ALLOCATOR_COMMANDS:
        # Here, before any command imports torch: libgomp reads its wait policy once, when torch
        # loads it. In os.environ, so the re-execution below (execve) carries it too.
        set_wait_policy(os.environ, machine_contended)
        # Also before torch: oneDNN and ideep read their cache capacities once (first matmul).
        bound_kernel_caches(os.environ)
        reexec_with_allocator()  # tcmalloc preloaded: returns only if already so, or not
    # The checks that need no model run before the command's module imports torch, so a wrong
    # flag fails in a fraction of a second.
    if args.check is not None:
        args.check(args)
    return int(command_function(args.run)(args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `leantune` console script."""
    try:
        args = parse(build_parser(), argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        # Returned, not raised: main() is also called in-process (tests, scripts) for its code.
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    quiet_import_noise()  # before any command imports peft
    install_env_faults()  # LEANTUNE_* test faults: runs started here only, never the library's
    args.own_process = argv is None  # the command line's own process, not a caller's
    code = _run_reporting(args, argv)
    if args.own_process and launched_by_torchrun():
        _leave_rank(code)
    return code


def _leave_rank(code: int) -> None:
    """End a torchrun rank with `code` once its exit handlers ran, without the interpreter's
    teardown: FSDP2's DTensor caches and DeepSpeed keep the gloo process group alive to the
    end (`destroy_process_group` does not stop its threads), and tearing the interpreter
    down under those threads aborted finished ranks intermittently ("terminate called
    without an active exception", SIGABRT), failing runs that had written everything."""
    # In the interpreter's own order: its threads joined, then the exit handlers.
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the process group, logging, the sinks' own handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_reporting(args: argparse.Namespace, argv: list[str] | None) -> int:
    """`run(args)`, its errors turned into the exit code and one line each."""
    try:
        return run(args)
    except UserError as e:
        # The rank prefix tells apart the same refusal printed by each torchrun process.
        print(f"error: {rank_tag()}{e}", file=sys.stderr)
        return e.exit_code
    except FileNotFoundError as e:  # a path the user gave: theirs to fix, not a crash
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside `train`, which handles its own signals
        print("interrupted (SIGINT)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `leantune ... | head`: the reader has all it wanted
        # Python would report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # leantune's bug: one labelled line, the traceback in a log file
        run_dir = getattr(args, "run_dir", None)  # set by the commands that have one (train)
        where = Path(run_dir) if run_dir else None
        # Unless a full or read-only disk refused a library's own write (a model's shards):
        # the user's to fix, like every refusal leantune's write helpers meet.
        output = where or (Path(args.out) if getattr(args, "out", None) else None)
        refused = writes.library_write_refused(e, output)
        if refused is not None:
            print(f"error: {rank_tag()}{refused}", file=sys.stderr)
            return refused.exit_code
        return report_internal_error(e, sys.argv[1:] if argv is None else argv, where, rank_tag())


if __name__ == "__main__":
    sys.exit(main())
