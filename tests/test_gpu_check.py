"""The device check (engine/measure/gpu_check.py) runs on the CPU as CI runs it: `gpu-check --dry-run` writes
results.json with every section, each section in a process of its own; a section that fails or outruns its cap is
recorded as such and the others still run."""

from __future__ import annotations

import json

import pytest
import torch

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
    assert [row["label"] for row in bench["runs"]] == ["ar", "sd", "pearl", "specbranch", "hf-assisted"] * 3
    assert all(row["finished"] and row["tokens_per_s"] > 0 for row in bench["runs"])  # each saved as it ended
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


def test_the_full_check_without_a_gpu_is_refused_at_once(tmp_path, capsys):
    """Without CUDA only the dry run makes sense: the full check would load the real pair onto the CPU for minutes."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the full check would run")  # the refusal is for machines without one
    code = main(["gpu-check", "--out", str(tmp_path)])
    assert code == 2 and "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_a_sections_result_is_on_disk_as_soon_as_each_part_is_done(tmp_path):
    """What a section stopped at its cap leaves: each part it finished (the driver keeps it as `kept`)."""
    out = gpu_check.Saved(tmp_path / "bench.json")
    out["real_pair"] = {"tokens_per_s": 1.0}
    assert json.loads((tmp_path / "bench.json").read_text()) == {
        "status": "partial",
        "result": {"real_pair": {"tokens_per_s": 1.0}},
    }


def test_the_check_imports_no_command_line():
    """gpu_check is imported by the CLI (engine/cli.py), so it must import none of it: a cycle (it imported cli's
    parse and with_preset for the bench)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(gpu_check.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "engine.cli" not in imported and "engine" not in imported


def test_a_failed_compile_is_not_paid_for_again(tmp_path, monkeypatch):
    """A compile that failed in a section (or a section stopped while compiling) turns compiling off for the
    sections after it, and results.json says after which and why."""
    asked = []

    def run_one(name, out_dir, dry, compile, cap):
        asked.append((name, compile))
        result = {"compile_failed": {"embedded": "InductorError: no kernel"}} if name == "greedy" else {}
        return {"status": "ok", "result": result}

    monkeypatch.setattr(gpu_check, "run_one", run_one)
    results = run_check(tmp_path, sections=("env", "greedy", "overlap", "bench"), log=lambda line: None)
    assert asked == [("env", True), ("greedy", True), ("overlap", False), ("bench", False)]
    assert results["compile_skipped"] == {"after": "greedy", "why": "embedded: InductorError: no kernel"}
    stopped = {"status": "timeout", "result": {"kept": {"compiling": True}}}
    assert gpu_check.compile_trouble(stopped) == "it ran out of time while compiling"
    assert gpu_check.compile_trouble({"status": "timeout", "result": {"kept": {"compiling": False}}}) == ""


def test_the_check_keeps_to_its_budget(tmp_path):
    """Each section's cap is at most what is left of the check's budget; a section with too little left is skipped,
    not started. The caps fit the budget, and the budget one device call with the install (scripts/device_carry.py)."""
    assert gpu_check.section_cap(100, 30) == 30 and gpu_check.section_cap(20, 300) == 20
    assert gpu_check.section_cap(20, gpu_check.MIN_LEFT_S - 0.1) is None
    skipped = run_check(tmp_path, sections=("env", "greedy"), log=lambda line: None, budget_s=1)
    assert [s["status"] for s in skipped["sections"].values()] == ["skipped", "skipped"]
    assert sum(gpu_check.CAPS_S.values()) <= gpu_check.BUDGET_S <= 8 * 60


def test_each_bench_run_is_on_disk_as_it_ends(tiny_engine, tmp_path):
    """The bench saves each entry's run as it ends (run_bench's log hooks): a bench stopped at its cap keeps every
    run it finished, where before it saved only after every entry of a pair."""
    from engine.config import GenerationConfig

    out = gpu_check.Saved(tmp_path / "bench.json")
    log = gpu_check.EntryLog(out, "real_pair", ["ar", "sd"])
    for label in ("ar", "sd"):
        recorder = log.start("a b c", None) if label == "ar" else log.another()
        tiny_engine.run([2, 3, 4], GenerationConfig(method=label, max_new_tokens=6, gamma=3), on_event=recorder.add)
        log.finish(recorder)
        runs = json.loads((tmp_path / "bench.json").read_text())["result"]["real_pair"]["runs"]
        assert runs[-1]["label"] == label and runs[-1]["finished"] and runs[-1]["tokens_per_s"] > 0
    assert len(runs) == 2 and {r["prompt"] for r in runs} == {0}


def test_the_greedy_check_casts_the_loaded_pair(tiny_dirs):
    """greedy loads the pair once: its bfloat16 half runs on a cast copy of the loaded target (the float32 one stays
    as it was, for the margins) with the same draft on it."""
    from engine.models.loading import load_pair

    pair = load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32", target_layouts=False
    )  # as on a GPU: the CPU's packed layouts do not copy
    copy = gpu_check.cast_pair(pair, torch.bfloat16)
    assert next(copy.target.model.parameters()).dtype == torch.bfloat16
    assert next(pair.target.model.parameters()).dtype == torch.float32
    assert copy.draft.name == pair.draft.name and copy.target.name == pair.target.name
    assert next(copy.draft.model.parameters()).dtype == torch.bfloat16
