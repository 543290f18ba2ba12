"""The flags of the commands that read a run's config: `train`, `validate`, `plan`, `inspect`
(they run in `cli.commands.train` and `cli.commands.inspect`).

Exit codes of `leantune train`: 0 done; 2 invalid config or data, or a run directory that is
not this run's (another process holds it, it is not a leantune run, or it holds a run with other
settings: the message lists them); 3 paused by the stability guard (a PAUSED marker in the run
dir; run the same command again to resume); 4 stopped by the guard (too many consecutive skipped
steps or rollbacks; a checkpoint was saved); 5 out of memory even at micro-batch size 1 (the
message names the next levers); 130 SIGINT, 143 SIGTERM, 129 SIGHUP (during training after a
checkpoint of the last applied step: the same command resumes). Every command: 70 an internal
error (a bug: one line names the log file that holds the traceback; `leantune.cli.crash`).
"""

from __future__ import annotations

from typing import Any

from leantune.cli.args import RawEpilogHelpFormatter, count, runs

CONFIG_ARGS = "[CONFIG.yaml] [section.key=value ...]"


def add_parsers(sub: Any) -> None:
    """`train`, `validate`, `plan` and `inspect`."""
    _add_train(sub)
    v = sub.add_parser("validate", help="check a config without loading a model")
    v.add_argument("args", nargs="*", help="CONFIG.yaml [section.key=value ...]")
    v.add_argument(
        "--help-fields",
        action="store_true",
        help="list every config field with its default and what it means, then exit",
    )
    runs(v, "leantune.cli.commands.train:cmd_validate")
    _add_plan(sub)
    _add_inspect(sub)


def _add_train(sub: Any) -> None:
    t = sub.add_parser(
        "train",
        help="fine-tune (no CONFIG and no data.train=...: the built-in demo)",
        # The exit-code paragraph of this module's docstring: one text for the code and --help.
        epilog=__doc__.split("\n\n")[1],
        formatter_class=RawEpilogHelpFormatter,
    )
    t.add_argument("args", nargs="*", help=CONFIG_ARGS)
    t.add_argument(
        "--metrics-port",
        type=count(0, 65535),
        default=None,
        metavar="N",
        help="serve Prometheus metrics on 127.0.0.1:N/metrics and /health while training "
        "(monitor.metrics_port; 0: any free port; default: off)",
    )
    t.add_argument(
        "--nproc",
        type=count(1),
        default=None,
        metavar="N",
        help="run on N processes of this machine: execs `torchrun --standalone "
        "--nproc-per-node N -m leantune train ...` (dist.strategy: auto = ddp; default: this "
        "process alone)",
    )
    t.add_argument(
        "--max-restarts",
        type=count(0),
        default=0,
        metavar="R",
        help="with --nproc: torchrun restarts all processes up to R times after one fails; "
        "each restart resumes from the newest checkpoint (default: 0)",
    )
    runs(t, "leantune.cli.commands.train:cmd_train")


def _add_plan(sub: Any) -> None:
    pl = sub.add_parser("plan", help="predict peak memory and the fastest settings that fit")
    pl.add_argument("args", nargs="*", help=CONFIG_ARGS)
    pl.add_argument(
        "--budget",
        default=None,
        help="e.g. 24GiB (default: train.memory_budget, else 90%% of available memory)",
    )
    pl.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cpu, or train.device when set",
    )
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    runs(pl, "leantune.cli.commands.train:cmd_plan")


def _add_inspect(sub: Any) -> None:
    i = sub.add_parser(
        "inspect",
        help="show what would be trained: examples with supervised tokens marked, lengths, "
        "packing, bad lines and the memory plan (writes nothing)",
        description="Reads the data and tokenizer only (and the model's config for the memory "
        "plan); writes nothing. Supervised tokens are bright green on a terminal and between "
        "[[ and ]] otherwise. Exits 2 when train would refuse the data.",
    )
    i.add_argument("args", nargs="*", help=CONFIG_ARGS)
    i.add_argument(
        "-n", "--examples", type=count(0), default=3, help="examples to show (default 3)"
    )
    i.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the supervised tokens (auto: when stdout is a terminal and NO_COLOR is unset)",
    )
    runs(i, "leantune.cli.commands.inspect:cmd_inspect")
