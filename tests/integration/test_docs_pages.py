"""The hand-written docs against the code they describe: the package map against the tree, every
relative link of README.md and docs/ against the files and headings it points at, the exit-code
table the README and the promises guide both show, and the command blocks marked
`<!-- run-on-tiny -->` run on the tiny test models.

The reference pages (CLI, config, metrics, API) are generated at build time and have their own
tests; here they count as link targets when mkdocs.yml's nav names them.
"""

from __future__ import annotations

import json
import re
import shlex
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from support import chat_rows, run_cli, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "leantune"
PACKAGE_MAP = DOCS / "reference" / "package-map.md"

# ---------------------------------------------------------------------------------------------
# The package map


def _tree_entries() -> set[str]:
    """Every module and package of src/leantune, as the map names them: `a/b.py`, `a/`."""
    modules = {
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if "__pycache__" not in p.parts and (p.name != "__init__.py" or p.parent == SRC)
    }
    packages = {
        f"{p.parent.relative_to(SRC).as_posix()}/"
        for p in SRC.rglob("__init__.py")
        if p.parent != SRC
    }
    return modules | packages


def _map_entries() -> dict[str, str]:
    """The package map's rows: path (first column, in backticks) -> what it owns."""
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", PACKAGE_MAP.read_text(encoding="utf-8"), re.M)
    return dict(rows)


def test_the_package_map_names_every_module_and_package_and_nothing_else() -> None:
    listed = _map_entries()
    in_tree = _tree_entries()
    missing = sorted(in_tree - set(listed))
    # Entries outside the package (benchmarks/, deploy/, ...) are paths from the repository root.
    absent = sorted(
        path for path in listed if not (SRC / path).exists() and not (ROOT / path).exists()
    )
    assert not missing and not absent, (
        f"{PACKAGE_MAP.relative_to(ROOT)} is out of date with src/leantune:\n"
        f"  missing (add a row saying what each owns): {missing}\n"
        f"  listed but not in the tree (moved or removed): {absent}"
    )
    assert all(text.strip() for text in listed.values())


# ---------------------------------------------------------------------------------------------
# Links


class _MkdocsLoader(yaml.SafeLoader):
    """YAML as mkdocs.yml writes it: `!!python/name:` and `!ENV` tags read as None."""


_MkdocsLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def _nav_pages() -> set[str]:
    """The pages mkdocs.yml's nav names, relative to docs/."""
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_MkdocsLoader)

    def pages(node: object) -> set[str]:
        if isinstance(node, str):
            return {node}
        if isinstance(node, list):
            return set().union(*(pages(n) for n in node))
        if isinstance(node, dict):
            return set().union(*(pages(v) for v in node.values()))
        return set()

    return pages(nav["nav"])


def _generated_pages() -> set[Path]:
    """Nav pages with no file on disk: the reference the docs build generates from the code."""
    return {DOCS / page for page in _nav_pages() if not (DOCS / page).exists()}


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _without_code(text: str) -> str:
    """The text with fenced blocks and inline code blanked out (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug_mkdocs(title: str) -> str:
    """Python-Markdown's toc slug (what the site's anchors are)."""
    value = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _slug_github(title: str) -> str:
    """GitHub's heading anchor (what the same link opens on github.com)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _anchors(path: Path, slug: Callable[[str], str]) -> set[str]:
    """The anchors of a page's headings (their text as shown: links and code marks removed)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    titles = re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M)
    shown = (re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "") for title in titles)
    return {slug(title) for title in shown}


def _both_anchors(path: Path) -> set[str]:
    """The anchors a link may use: the same on the site and on GitHub."""
    return _anchors(path, _slug_mkdocs) & _anchors(path, _slug_github)


def _links(path: Path) -> list[str]:
    text = _without_code(path.read_text(encoding="utf-8"))
    return re.findall(r"\]\(([^)\s]+)(?: \"[^\"]*\")?\)", text)


def test_every_relative_link_of_the_readme_and_the_docs_points_at_a_file_and_heading() -> None:
    generated = _generated_pages()
    assert all(p.parent == DOCS / "reference" for p in generated), (
        f"mkdocs.yml's nav names pages that do not exist: {sorted(map(str, generated))}"
    )
    broken = []
    for page in _markdown_files():
        for link in _links(page):
            if re.match(r"[a-z]+:", link):
                continue  # https:, mailto:: not this test's to fetch
            target, _, anchor = link.partition("#")
            dest = (page.parent / target).resolve() if target else page
            where = f"{page.relative_to(ROOT)}: {link}"
            if dest in generated:
                continue
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _both_anchors(dest):
                broken.append(f"{where} (no heading with that anchor, on the site and GitHub)")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_every_docs_page_is_in_the_nav() -> None:
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk - _nav_pages() == set()


# ---------------------------------------------------------------------------------------------
# The exit codes


def _exit_code_rows(path: Path) -> list[str]:
    return re.findall(r"^\| (?:\d+|\d+ / \d+ / \d+) \|.*$", path.read_text(encoding="utf-8"), re.M)


def test_the_readme_shows_the_exit_codes_the_promises_guide_does() -> None:
    promised = _exit_code_rows(DOCS / "guides" / "promises.md")
    assert [r.split(" | ")[0] for r in promised] == [
        "| 0",
        "| 1",
        "| 2",
        "| 3",
        "| 4",
        "| 5",
        "| 70",
        "| 130 / 143 / 129",
    ]
    assert _exit_code_rows(ROOT / "README.md") == promised


# ---------------------------------------------------------------------------------------------
# Command blocks that run on the tiny models

MARK = re.compile(r"^<!-- run-on-tiny( slow)? -->$")
# The data files the marked blocks name, made here: a file a block names that is not listed
# fails the test, saying so.
DATA_FILES: dict[str, Callable[[], list[object]]] = {
    "my.jsonl": lambda: [*chat_rows(16)],
    "my_held_out.jsonl": lambda: [*chat_rows(4, offset=100)],
}
# What makes a run on a tiny model quick; appended, so they win over the block's settings.
QUICK = {
    "train": ["train.max_steps=2", "run.progress=false", "train.save_every=0"],
    "generate": ["--max-new-tokens", "4"],
}
NEEDS_MODEL = {"train", "plan", "inspect"}


@dataclass(frozen=True)
class Block:
    """A marked command block: where it is, its commands, and whether it is slow."""

    where: str
    commands: tuple[tuple[str, ...], ...]
    slow: bool


def _marked_blocks() -> list[Block]:
    blocks: dict[tuple[tuple[str, ...], ...], Block] = {}
    for page in _markdown_files():
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not (m := MARK.match(line)):
                continue
            where = f"{page.relative_to(ROOT)}:{i + 1}"
            assert lines[i + 1] == "```bash", f"{where}: the mark must precede a ```bash block"
            end = lines.index("```", i + 2)
            text = "\n".join(lines[i + 2 : end]).replace("\\\n", " ")
            rows = [shlex.split(row, comments=True) for row in text.splitlines()]
            commands = tuple(tuple(words) for words in rows if words)
            assert commands and all(c[0] == "leantune" for c in commands), where
            # The README and a guide may show the same block: it runs once.
            blocks.setdefault(commands, Block(where, commands, bool(m.group(1))))
    return list(blocks.values())


def _on_tiny(words: tuple[str, ...], model: Path, workdir: Path) -> list[str]:
    """The command's arguments with its model path replaced by the tiny model's, its data files
    made, and the settings of `QUICK` appended."""
    command, args = words[1], list(words[2:])
    out = []
    for arg in args:
        if arg.startswith("/models/"):
            arg = str(model)
        elif arg.startswith("model.path=/models/"):
            arg = f"model.path={model}"
        for name in re.findall(r"[\w.-]+\.jsonl\b", arg):
            if not (workdir / name).exists() and not arg.startswith(("runs/", "exports/")):
                assert name in DATA_FILES, f"a marked block names {name}: add it to DATA_FILES"
                write_jsonl(workdir / name, DATA_FILES[name]())
        out.append(arg)
    if command in NEEDS_MODEL and not any(a.startswith("model.path=") for a in out):
        out.append(f"model.path={model}")
    return [command, *out, *QUICK.get(command, [])]


def _check(command: str, out: str, workdir: Path) -> None:
    """What each command's run must show beyond exit 0."""
    if command == "train":
        run_dir = re.search(r"run directory: (\S+)", out)
        assert run_dir and (workdir / run_dir.group(1) / "final").is_dir(), out[-2000:]
    elif command == "eval":
        # The first JSON value: stdout's result, before the notes on stderr.
        scores, _ = json.JSONDecoder().raw_decode(out[out.index("{") :])
        assert "loss" in scores or "preference_accuracy" in scores, scores
    else:
        assert out.strip(), f"{command} printed nothing"


_BLOCKS = _marked_blocks()


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.where, marks=[pytest.mark.slow] if b.slow else []) for b in _BLOCKS],
)
def test_a_marked_command_block_runs_on_the_tiny_model(
    block: Block, tiny_qwen2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for words in block.commands:
        args = _on_tiny(words, tiny_qwen2_dir, tmp_path)
        result = run_cli(args)
        assert result.code == 0, f"{block.where}: leantune {' '.join(args)}\n{result.err[-3000:]}"
        _check(args[0], result.out + result.err, tmp_path)


def test_the_guides_mark_blocks_for_a_first_run_inspect_and_plan() -> None:
    commands = {words[1] for b in _BLOCKS if not b.slow for words in b.commands}
    assert {"train", "eval", "generate", "inspect", "plan"} <= commands
