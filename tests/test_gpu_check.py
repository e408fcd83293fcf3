"""The device check (engine/measure/gpu_check.py) runs on the CPU as CI runs it: `gpu-check --dry-run` writes
results.json with every section, each section in a process of its own; a section that fails or outruns its cap is
recorded as such and the others still run."""

from __future__ import annotations

import json

import pytest

from engine.cli import main
from engine.measure import gpu_check
from engine.measure.gpu_check import SECTIONS, first_divergence, run_check


@pytest.mark.slow
def test_the_dry_run_writes_every_section(tmp_path):
    # the caps are the check's own business (the next test); here each section must finish and be right, however
    # busy the machine that runs the suite is
    run_check(tmp_path, dry=True, log=lambda line: None, caps={name: 900 for name in SECTIONS})
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["dry_run"] is True and list(results["sections"]) == list(SECTIONS)
    for name, section in results["sections"].items():
        assert section["status"] == "ok", (name, section["result"])
    r = {name: s["result"] for name, s in results["sections"].items()}
    assert r["env"]["device"] == "cpu" and r["env"]["torch"]
    greedy = r["greedy"]["float32"]
    assert greedy["runs"] == 8 and greedy["identical"] == greedy["runs"]  # 2 prompts x ar, sd, pearl, specbranch
    overlap = r["overlap"]["real_pair"]
    for arrangement in ("two_streams", "shared_stream", "sequential"):
        assert overlap[arrangement]["efficiency"] > 0
    assert (tmp_path / r["overlap"]["trace"]["file"]).stat().st_size > 0
    bench = r["bench"]["real_pair"]
    # the engine's methods are exact; hf-assisted is transformers' own loop, an outside peer that only has to run
    assert {m: bench["identical_to_ar"][m] for m in ("sd", "pearl", "specbranch")} == {
        m: "3/3" for m in ("sd", "pearl", "specbranch")
    }
    assert bench["summary"]["hf-assisted"]["tokens_per_s"] > 0
    assert bench["summary"]["ar"]["speedup_vs_ar"] == 1.0
    krow = r["krow"]["real_pair"]
    assert list(krow["draft_ms_by_rows"]) == ["1", "2", "3", "4"]
    assert list(krow["target_beside_draft_rows"]["target_busy_ms"]) == ["1", "2", "3", "4"]


def test_a_section_over_its_cap_is_recorded_and_the_next_still_runs(tmp_path):
    results = run_check(
        tmp_path, dry=True, sections=("env", "sanitizer"), log=lambda line: None, caps={"env": 0.05, "sanitizer": 60}
    )  # no Python imports torch in 50 ms
    assert results["sections"]["env"]["status"] == "timeout" and results["sections"]["env"]["result"]["kept"] == {}
    assert results["sections"]["sanitizer"]["status"] == "ok"
    assert json.loads((tmp_path / "results.json").read_text())["sections"].keys() == {"env", "sanitizer"}


def test_a_section_that_raises_is_recorded_with_its_error(tmp_path, monkeypatch):
    def broken(name, setup, out_dir):
        raise RuntimeError("the kernel broke")

    monkeypatch.setattr(gpu_check, "run_section", broken)
    gpu_check.section_main("greedy", tmp_path, dry=True)
    done = json.loads((tmp_path / "greedy.json").read_text())
    assert done["status"] == "error" and "RuntimeError: the kernel broke" in done["result"]["error"]


@pytest.mark.parametrize(
    "ours, ref, at", [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [4], 0)]
)
def test_first_divergence(ours, ref, at):
    assert first_divergence(ours, ref) == at


def test_unknown_sections_are_refused(tmp_path, capsys):
    assert main(["gpu-check", "--out", str(tmp_path), "--sections", "env,bogus"]) == 2
    assert "unknown bogus" in capsys.readouterr().err


def test_a_sections_result_is_on_disk_as_soon_as_each_part_is_done(tmp_path):
    """What a section stopped at its cap leaves: each part it finished (the driver keeps it as `kept`)."""
    out = gpu_check.Saved(tmp_path / "bench.json")
    out["real_pair"] = {"tokens_per_s": 1.0}
    assert json.loads((tmp_path / "bench.json").read_text()) == {
        "status": "partial",
        "result": {"real_pair": {"tokens_per_s": 1.0}},
    }
