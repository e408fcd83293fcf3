"""A script of the repository that is not a package's module (a results tool, scripts/, app.py), loaded as one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(path: str, name: str | None = None):
    """The script at `path` (from the repository's root), run as a module named `name` (default: its stem), and
    registered under it in sys.modules, as an import would (a dataclass looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
