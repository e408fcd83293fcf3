"""Every package the product's code imports is named in requirements.txt, the file a Space installs: a package that
only arrives as another's dependency can leave with that dependency's next release."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("app", "engine", "sessions")
# the ZeroGPU package comes with a Space's image (docs/hosting.md); the suite installs it from requirements-dev.txt
FROM_THE_IMAGE = {"spaces"}


def named_in(path: Path) -> set[str]:
    """The distributions a requirements file names (its -r includes aside)."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(Requirement(line).name) for line in lines if line and not line.startswith("-")}


def imported_by(paths: list[Path]) -> dict[str, set[str]]:
    """Top-level module -> the files that import it, anywhere in the file, absolute imports only."""
    out: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                out.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return out


def third_party(imports: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: f for m, f in imports.items() if m not in sys.stdlib_module_names and m not in PRODUCT}


def undeclared(imports: dict[str, set[str]], declared: set[str]) -> dict[str, list[str]]:
    """Third-party modules whose distribution is not declared, with the files that import them."""
    distributions = importlib.metadata.packages_distributions()
    out = {}
    for module, files in third_party(imports).items():
        names = {canonicalize_name(d) for d in distributions.get(module, [module])}
        if not names & declared and module not in FROM_THE_IMAGE:
            out[module] = sorted(files)
    return out


def product_files() -> list[Path]:
    return [ROOT / "app.py"] + sorted(p for package in PRODUCT for p in (ROOT / package).rglob("*.py"))


def test_every_package_the_product_imports_is_in_requirements_txt():
    imports = imported_by(product_files())
    assert {"torch", "transformers", "numpy", "gradio", "sqlite_utils"} <= set(third_party(imports))  # it sees them
    assert undeclared(imports, named_in(ROOT / "requirements.txt")) == {}


def test_an_import_that_only_arrives_as_a_dependency_is_caught(tmp_path):
    # numpy arrives with transformers and gradio: a requirements.txt without it must not pass
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(
        "\n".join(line for line in (ROOT / "requirements.txt").read_text().splitlines() if "numpy" not in line)
    )
    got = undeclared(imported_by(product_files()), named_in(requirements))
    assert set(got) == {"numpy"} and "engine/kernels/vocab.py" in got["numpy"]
    assert named_in(ROOT / "requirements-dev.txt") >= {"pytest", "spaces"}
