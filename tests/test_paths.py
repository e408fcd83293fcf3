"""Every repository path that the code, the --help texts and the docs name exists: a file path under one of the
repository's folders (`engine/methods/parallel.py`, `docs/app.md`, `data/...`), a relative Markdown link, and a
dotted module reference (`engine.methods.parallel`, `engine.measure.metrics.draft_waste`). A file that moves leaves
no stale name behind. URLs, paths inside other paths (runs/x/engine/...), placeholders the user fills in (PATH.gguf,
weights/<name>/) and code (a variable `engine.pair`) are not names of repository files and are not read."""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

from .scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "app", "sessions", "tests", "docs", "scripts", "data", "weights", "static", ".ci")
PACKAGES = ("engine", "app", "sessions", "tests", "scripts")
TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml", ".txt", ".ini", ".css")
TEXT_NAMES = ("Makefile", "run")
# a path starts a token (not inside a URL or another path) at one of the folders; `*` globs
PATH = re.compile(r"(?<![\w./~$<-])((?:" + "|".join(map(re.escape, FOLDERS)) + r")/[\w.*/-]*)")
DOTTED = re.compile(r"(?<![\w./])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# a dotted name ending so is a file name (app.py, sessions.md), not a module
FILE_SUFFIXES = {"py", "md", "css", "log", "json", "jsonl", "txt", "toml", "sh", "png", "gz", "db"}

# a path after one of these is one that a command writes: it need not exist yet
OUTPUT_FLAGS = re.compile(r"(?:--json|--out|--work-dir|--samples|>)\s*$")
# (file, path) pairs that name no file of this tree on purpose, each with the reason
NOT_OURS = {
    # a folder of an old commit, read with `git archive 75303b3 engine/drafts/smollm2-135m-draft`
    ("docs/results/tools/run_drafts.sh", "engine/drafts/smollm2-135m-draft"),
    # files of the throwaway repository the test builds
    ("tests/test_device_carry.py", "weights/d/README.md"),
}
THIS = "tests/test_paths.py"  # its strings are the check's examples, stale on purpose


def repo_files() -> list[str]:
    """The files of this tree that git tracks or would (untracked, not ignored); outside a git checkout (an unpacked
    archive), every file but the hidden ones, caches and run outputs."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        skip = {"__pycache__", "runs", "node_modules"}
        return sorted(
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)
        )
    return sorted({name for name in out.splitlines() if (ROOT / name).is_file()})


def is_text(name: str) -> bool:
    path = Path(name)
    return path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES


def prose(name: str, text: str) -> list[tuple[int, str]]:
    """(line, text) of what a file says in words: a Python file's comments and strings (an f-string's {...} parts
    are code: each stands as <>), any other file whole."""
    if not name.endswith(".py"):
        return list(enumerate(text.splitlines(), 1))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT or tok.type == tokenize.STRING:
            out.append(
                (tok.start[0], re.sub(r"\{[^{}]*\}", "<>", tok.string) if is_fstring(tok.string) else tok.string)
            )
        elif tok.type == getattr(tokenize, "FSTRING_MIDDLE", None):
            out.append((tok.start[0], tok.string))
    return out


def is_fstring(literal: str) -> bool:
    prefix = re.match(r"[A-Za-z]*", literal).group(0)
    return "f" in prefix.lower()


def path_exists(ref: str) -> bool:
    if "*" in ref:
        return any(ROOT.glob(ref.rstrip("/")))
    return (ROOT / ref).exists()


def paths_in(text: str) -> list[str]:
    """The repository paths `text` names: not those a command writes (OUTPUT_FLAGS), nor one in a regular
    expression (engine/__main__\\.py)."""
    return [
        m.group(1).rstrip(".")
        for m in PATH.finditer(text)
        if not OUTPUT_FLAGS.search(text[: m.start()]) and not text.startswith("\\", m.end())
    ]


def module_file(parts: list[str]) -> Path | None:
    path = ROOT.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def top_level_names(source: Path) -> set[str]:
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def module_ref_exists(ref: str) -> bool:
    """engine.a.b(.name...): the longest run of modules exists, and the first name after it is defined in the last
    one (a function, class, constant or import)."""
    parts = ref.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return True
    depth = 1
    while depth < len(parts) and module_file(parts[: depth + 1]) is not None:
        depth += 1
    if depth == len(parts):
        return True
    source = module_file(parts[:depth])
    if source is None:  # a folder without __init__.py (scripts/): only its modules can be named
        return False
    return parts[depth] in top_level_names(source)


def markdown_links(name: str, text: str) -> list[tuple[int, str]]:
    """(line, target) of each relative link of a Markdown file, its #anchor dropped."""
    out = []
    for line, words in enumerate(text.splitlines(), 1):
        for m in LINK.finditer(words):
            target = m.group(1).split("#")[0]
            if target and not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                out.append((line, target))
    return out


def stale_in_file(name: str, text: str) -> list[str]:
    """Where `text`, the file `name`, names a repository path or module that does not exist."""
    stale = []
    for line, words in prose(name, text):
        for ref in paths_in(words):
            if (name, ref) not in NOT_OURS and not path_exists(ref):
                stale.append(f"{name}:{line}: {ref}")
        for ref in (m.group(1) for m in DOTTED.finditer(words)):
            if (name, ref) not in NOT_OURS and not module_ref_exists(ref):
                stale.append(f"{name}:{line}: {ref}")
    if name.endswith(".md"):
        for line, target in markdown_links(name, text):
            if not ((ROOT / name).parent / target).exists():
                stale.append(f"{name}:{line}: link {target}")
    return stale


def load_app_script():
    """app.py at the root (a module apart: `app` is the package)."""
    return load_script("app.py", "app_script")


def help_texts(parser: argparse.ArgumentParser) -> list[str]:
    """A parser's --help and each of its subcommands' (help strings are often split over several literals)."""
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                texts += help_texts(sub)
    return texts


def test_every_path_named_in_code_and_docs_exists():
    stale = []
    for name in (n for n in repo_files() if is_text(n) and n != THIS):
        stale += stale_in_file(name, (ROOT / name).read_text(errors="replace"))
    assert not stale, "stale paths:\n" + "\n".join(stale)


def test_every_path_named_in_help_exists():
    from app.load_test import build_parser as load_test_parser
    from engine.cli import build_parser as engine_parser
    from sessions.__main__ import build_parser as sessions_parser

    parsers = [engine_parser(), sessions_parser(), load_test_parser(), load_app_script().build_parser()]
    stale = [
        f"--help: {ref}"
        for parser in parsers
        for text in help_texts(parser)
        for ref in paths_in(" ".join(text.split()))  # argparse wraps its lines: a path may span two
        if not path_exists(ref)
    ]
    assert not stale, "stale paths in --help:\n" + "\n".join(stale)


def test_a_stale_path_is_found():
    """The check itself: a planted stale path, module and link are reported; URLs, paths inside other paths,
    placeholders and code are not."""
    source = '''
x = engine.pair.draft  # engine/no_such_module.py, as engine.no_such_module says
URL = "https://example.org/engine/nothing.py"  # runs/v2/engine/nothing.py; PATH.gguf; weights/<name>/
"""engine.methods.parallel and engine.measure.metrics.draft_waste exist; engine/models/lean.py too."""
'''
    stale = stale_in_file("planted.py", source)
    assert stale == ["planted.py:2: engine/no_such_module.py", "planted.py:2: engine.no_such_module"]
    assert stale_in_file("planted.md", "[a](docs/app.md) [b](no-such.md) [c](https://x.org/y.md)") == [
        "planted.md:1: link no-such.md"
    ]
