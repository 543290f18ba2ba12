"""The CPU memory allocator, chosen rather than inherited: tcmalloc where it is installed.

A training step on CPU allocates and frees gigabytes of tensors whose sizes change with every
packed row. glibc's malloc keeps the freed blocks of each size class around (the process's RSS
grows step after step: 5.4 to 7.7 GiB over the LoRA benchmark's 15 steps) and hands large
blocks to the kernel and back with mmap/munmap, paying page faults on every step. tcmalloc
(gperftools) keeps per-size free lists and returns memory gradually: on the same run, the same
losses, 1.46x the tokens/s at 0.69x the peak RSS (benchmarks/results/allocator-lora-cpu.json).
jemalloc, with its defaults or with the settings PyTorch's CPU launcher uses, was slower than
glibc there. PyTorch's own launcher (`torch.backends.xeon.run_cpu`) also defaults to tcmalloc.

An allocator is chosen before the process starts (LD_PRELOAD), so the `leantune` command
re-executes itself once with the library preloaded (`os.execve`: the same process id, so
torchrun's agent and a shell's job control see no difference). `LEANTUNE_ALLOCATOR` says which:
`auto` (the default: tcmalloc if found, else glibc's, with a hint), `tcmalloc` (an error if
missing) or `system` (glibc's). An allocator the user preloaded themselves is left alone. The
Python API and in-process calls keep the allocator of the process that imported leantune.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

from leantune.errors import UserError

ENV = "LEANTUNE_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "system")
MARK = "LEANTUNE_PRELOADED"
"""Set to the library leantune added to LD_PRELOAD: its children can take it out again (the
benchmark's HF baseline runs with the allocator a user of it would have)."""
# The versioned names first: the runtime packages (libtcmalloc-minimal4, gperftools-libs)
# install only those, the unversioned links come with the -dev packages. The minimal build
# first: it leaves out the heap profiler and checker, which training does not use.
TCMALLOC_NAMES = (
    "libtcmalloc_minimal.so.4",
    "libtcmalloc.so.4",
    "libtcmalloc_minimal.so",
    "libtcmalloc.so",
)
# Matched in the names of preloaded or mapped libraries: a user's own choice of allocator.
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")
INSTALL_HINT = (
    "install tcmalloc for faster CPU training with less memory: `apt-get install "
    "libtcmalloc-minimal4` (Debian/Ubuntu), `dnf install gperftools-libs` (Fedora) or "
    "`conda install gperftools`"
)


def library_dirs(environ: Mapping[str, str]) -> list[Path]:
    """Where to look for tcmalloc: the active environment's lib (conda, venv), then the
    system's library folders (the multiarch one first, as the dynamic loader does)."""
    dirs = [Path(environ[k]) / "lib" for k in ("CONDA_PREFIX", "VIRTUAL_ENV") if environ.get(k)]
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for base in ("/usr/local/lib", "/usr/lib", "/lib"):
        if multiarch:
            dirs.append(Path(base) / multiarch)
        dirs.append(Path(base))
    dirs += [Path("/usr/lib64"), Path("/usr/local/lib64")]
    return dirs


def find_tcmalloc(dirs: Sequence[Path]) -> Path | None:
    """The first tcmalloc library in `dirs`, or None."""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            if (d / name).is_file():
                return d / name
    return None


def _preloaded(environ: Mapping[str, str]) -> list[str]:
    # ld.so accepts spaces as well as colons between LD_PRELOAD entries.
    return [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def preload_for(environ: Mapping[str, str], dirs: Sequence[Path] | None = None) -> Path | None:
    """The library to preload for a `leantune` process started with `environ`; None to keep
    the process as it is (glibc's allocator chosen, or one already preloaded).

    Raises:
        UserError: LEANTUNE_ALLOCATOR has an unknown value, or asks for tcmalloc and none is
            installed.
    """
    choice = environ.get(ENV, "auto").strip().lower() or "auto"  # set but empty: the default
    if choice not in CHOICES:
        raise UserError(
            f"{ENV}={environ[ENV]!r}: must be one of {', '.join(CHOICES)} "
            "(auto: tcmalloc if installed, else glibc's malloc)"
        )
    # An allocator the user preloaded is theirs to keep; preloading a second would make the
    # two fight over malloc.
    if choice == "system" or any(
        a in Path(p).name for p in _preloaded(environ) for a in OTHER_ALLOCATORS
    ):
        return None
    dirs = library_dirs(environ) if dirs is None else dirs
    found = find_tcmalloc(dirs)
    if found is None and choice == "tcmalloc":
        raise UserError(
            f"{ENV}=tcmalloc: no tcmalloc library ({', '.join(TCMALLOC_NAMES[:2])}) in "
            f"{', '.join(str(d) for d in dirs)}; {INSTALL_HINT}, or set {ENV}=auto"
        )
    return found


def preloaded_environment(environ: Mapping[str, str], library: Path) -> dict[str, str]:
    """`environ` with `library` first in LD_PRELOAD, marked as leantune's."""
    env = dict(environ)
    # First: the loader binds malloc to the first preloaded library that defines it.
    env["LD_PRELOAD"] = ":".join([str(library), *_preloaded(environ)])
    env[MARK] = str(library)
    # tcmalloc reports every allocation over 1 GiB on stderr by default ("tcmalloc: large
    # alloc"); a training step's logits and attention buffers are such allocations, not news.
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    return env


def without_leantune_preload(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the library leantune preloaded (a user's own preloads stay)."""
    env = dict(environ)
    ours = env.pop(MARK, None)
    if ours is not None:
        rest = [p for p in _preloaded(env) if p != ours]
        if rest:
            env["LD_PRELOAD"] = ":".join(rest)
        else:
            env.pop("LD_PRELOAD", None)
    return env


def reexec_with_allocator() -> None:
    """Re-execute this `leantune` command with tcmalloc preloaded when `preload_for` asks for
    it and this process was not started so (then it returns; so does a failed exec, which
    keeps the allocator this process has)."""
    library = preload_for(os.environ)
    if library is None:  # glibc chosen, or an allocator (ours included) already preloaded
        return
    if Path(sys.argv[0]).name == "__main__.py":  # python [options] -m leantune ...
        # orig_argv keeps the interpreter's own options (-X, -W, -u) for the new process.
        argv = [sys.executable, *sys.orig_argv[1:]]
    else:  # the console script, or main() called by a script of the user's
        argv = [sys.executable, "-m", "leantune", *sys.argv[1:]]
    # execve replaces the process image: anything still in Python's buffers would be lost.
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # execve, not a child process: the same process id, so torchrun's agent and a shell's
        # job control see no difference.
        os.execve(sys.executable, argv, preloaded_environment(os.environ, library))
    except OSError:
        return


def mapped_allocator(maps: Path = Path("/proc/self/maps")) -> tuple[str, str | None]:
    """The allocator this process runs with, read from the libraries it has mapped (not from
    what was asked): ("tcmalloc", its path), ("jemalloc", ...), or ("glibc", None)."""
    try:
        mapped = maps.read_text()
    except OSError:
        mapped = ""
    for line in mapped.splitlines():
        if "/" not in line:  # anonymous mappings ([heap], [stack], ...) name no file
            continue
        path = line[line.index("/") :]
        for a in OTHER_ALLOCATORS:
            if Path(path).name.startswith(f"lib{a}"):
                return a, path
    return "glibc", None


def allocator_note(maps: Path = Path("/proc/self/maps")) -> str:
    """The log line that says which allocator this process runs with and how to change it."""
    name, path = mapped_allocator(maps)
    if path is not None:
        ours = os.environ.get(MARK)
        how = (
            f"{ENV}=system for glibc's"
            if ours and Path(ours).resolve() == Path(path).resolve()
            else "preloaded by you (LD_PRELOAD)"
        )
        return f"allocator: {name} ({path}; {how})"
    if os.environ.get(ENV, "").strip().lower() == "system":
        return f"allocator: glibc's malloc ({ENV}=system)"
    return f"allocator: glibc's malloc; {INSTALL_HINT} (the leantune command preloads it)"


def train_allocator(environ: Mapping[str, str] = os.environ) -> str:
    """The allocator a `leantune train` started from `environ` runs with ("tcmalloc", "glibc",
    ...): one this process already has, else the one `reexec_with_allocator` would preload.
    What `leantune plan` sizes its margin by (`memory.estimate.FIT_MARGIN`)."""
    name, path = mapped_allocator()
    if path is not None:
        return name
    return "tcmalloc" if preload_for(environ) is not None else "glibc"
