"""The CLI's JSON contract, the event stream's completeness and serialisation, and the metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from engine.cli import main
from engine.config import GenerationConfig
from engine.events import (
    DraftProposed,
    Finished,
    RunStarted,
    StepStarted,
    TimingSpan,
    TokensEmitted,
    Verified,
    from_dict,
)
from engine.kernels import panel
from engine.measure.metrics import compute_metrics
from engine.models.loading import draft_matmul_kind


def test_generate_json(capsys, tiny_dirs):
    code = main(
        [
            "generate",
            "--method",
            "sd",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--device",
            "cpu",
            "--prompt",
            "a b c",
            "--max-new-tokens",
            "12",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert out["method"] == "sd" and len(out["token_ids"]) == 12
    for key in ("tokens_per_s", "acceptance_rate", "mean_accepted_length", "path_rollback_rate", "wasted_draft_rate"):
        assert key in out["metrics"]
    assert isinstance(out["text"], str) and out["text"]


def test_generate_prompt_file(capsys, tiny_dirs, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n{"prompt": "c d e"}\n')
    code = main(
        [
            "generate",
            "--method",
            "ar",
            "--target",
            str(tiny_dirs["target"]),
            "--device",
            "cpu",
            "--prompt-file",
            str(f),
            "--max-new-tokens",
            "5",
            "--json",
        ]
    )
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 2 and all(len(x["token_ids"]) == 5 for x in lines)


def test_bench_writes_speedups(capsys, tiny_dirs, tmp_path):
    prompts = tmp_path / "b.jsonl"
    prompts.write_text('{"prompt": "a b", "chat": false}\n{"prompt": "c d", "chat": false}\n')
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--methods",
            "ar,sd",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--device",
            "cpu",
            "--dataset",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["results"]["ar"]["all"]["speedup_vs_ar"] == 1.0
    sd = report["results"]["sd"]["all"]
    assert sd["prompts"] == 2 and sd["speedup_vs_ar"] > 0 and sd["acceptance_rate"] is not None
    assert "speedup" in capsys.readouterr().out
    auto = draft_matmul_kind("auto", torch.device("cpu"), torch.float32)  # the rule (tests/test_lm_head.py)
    assert report["draft_matmul"] == {"ar": None, "sd": auto}
    assert report["draft_forward"] == {"ar": None, "sd": "lean"}  # the default for a Llama draft on the CPU
    assert report["draft_worker"] == {"ar": None, "sd": "process"}  # the CLI's default, where the draft fits it
    # whether the few-row kernel ran, or why not: a reader comparing machines needs it
    assert report["machine"]["few_row_kernel"] == ("on" if panel.available() else panel.why_not())
    cpu = report["machine"]["cpu"]  # which processor: the same kernel image runs on more than one
    assert cpu and cpu != "unknown"
    info = Path("/proc/cpuinfo").read_text() if sys.platform == "linux" else ""
    if "model name" in info:  # the kernel names the model (x86; not every ARM kernel does)
        assert f": {cpu}\n" in info
    assert report["branch_costs"] == {}  # measured only for --branch-costs
    assert (
        main(
            [
                "bench",
                "--methods",
                "sd,hf-assisted",
                "--target",
                str(tiny_dirs["target"]),
                "--draft",
                str(tiny_dirs["draft"]),
                "--device",
                "cpu",
                "--dataset",
                str(prompts),
                "--max-new-tokens",
                "4",
                "--draft-matmul",
                "float32",
                "--draft-worker",
                "thread",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["draft_matmul"] == {"sd": "float32", "hf-assisted": "float32"}
    assert report["draft_forward"] == {"sd": "lean", "hf-assisted": "transformers"}  # generate() runs the model
    assert report["draft_worker"] == {"sd": "thread", "hf-assisted": "thread"}


def test_summarize_gives_mean_and_spread_over_seeds(capsys, tiny_dirs, tmp_path):
    prompts = tmp_path / "b.jsonl"
    prompts.write_text('{"prompt": "a b", "chat": false}\n')
    outs = []
    for seed in (0, 1):
        outs.append(tmp_path / f"s{seed}.json")
        assert (
            main(
                [
                    "bench",
                    "--methods",
                    "ar,specbranch",
                    "--target",
                    str(tiny_dirs["target"]),
                    "--draft",
                    str(tiny_dirs["draft"]),
                    "--device",
                    "cpu",
                    "--dataset",
                    str(prompts),
                    "--max-new-tokens",
                    "8",
                    "--temperature",
                    "1",
                    "--seed",
                    str(seed),
                    "--json",
                    str(outs[-1]),
                ]
            )
            == 0
        )
    summary_path = tmp_path / "summary.json"
    assert main(["summarize", *map(str, outs), "--json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    reports = [json.loads(o.read_text()) for o in outs]
    tps = [r["results"]["specbranch"]["all"]["tokens_per_s"] for r in reports]
    row = summary["methods"]["specbranch"]["tokens_per_s"]
    assert row["n"] == 2 and abs(row["mean"] - sum(tps) / 2) < 1e-3
    assert abs(row["sd"] - abs(tps[0] - tps[1]) / 2**0.5) < 1e-3
    assert [r["seed"] for r in summary["runs"]] == [0, 1]
    # what the SpecBranch runs measured, by method (each keeps its own tables); the top-level pair is specbranch's
    assert all(list(r["calibration_by_method"]) == ["specbranch"] for r in reports)
    assert all(
        r["acceptance_by_confidence"] == r["calibration_by_method"]["specbranch"]["acceptance_by_confidence"]
        and sum(b["judged"] for b in r["acceptance_by_confidence"]) > 0
        for r in reports
    )
    assert "± " in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("[1]")
    assert main(["summarize", str(tmp_path / "bad.json")]) == 2
    assert "not a bench report" in capsys.readouterr().err


def test_event_stream_is_complete_and_round_trips(tiny_engine):
    r = tiny_engine.run([2, 3, 4], GenerationConfig(method="sd", max_new_tokens=20, gamma=3, temperature=1.0, seed=3))
    kinds = {type(e) for e in r.events}
    assert {RunStarted, StepStarted, DraftProposed, Verified, TokensEmitted, TimingSpan, Finished} <= kinds
    for e in r.events:
        assert from_dict(json.loads(json.dumps(e.to_dict()))) == e
    # metrics are a pure function of the stream, so a replay computes the same numbers
    finished = r.events[-1]
    assert isinstance(finished, Finished)
    assert (
        compute_metrics(
            r.events[:-1] + [Finished(finished.reason, finished.prefill_s, finished.decode_s, finished.new_tokens, {})]
        )
        == finished.metrics
    )
    emitted = [t for e in r.events if isinstance(e, TokensEmitted) for t in e.tokens]
    assert emitted == r.token_ids and len(emitted) == 20
    # the first token comes from the target's prefill; accepted tokens are those the verifications accepted
    verified = [e for e in r.events if isinstance(e, Verified)]
    kinds = [k for e in r.events if isinstance(e, TokensEmitted) for k in e.kinds]
    assert kinds[0] == "target"
    assert kinds.count("accepted") == sum(v.accepted for v in verified)
    assert kinds.count("correction") + kinds.count("bonus") == len(verified)


def test_metrics_from_known_spans():
    spans = [
        TimingSpan("target", "prefill", 0, 0.0, 1.0),
        TimingSpan("target", "verify", 1, 1.0, 2.0),
        TimingSpan("draft", "draft", 1, 1.5, 2.5),
        TimingSpan("target", "verify", 2, 2.5, 3.0),
    ]
    events = spans + [
        TokensEmitted(0, [5], ["x"], ["target"], "x"),
        TokensEmitted(1, [6, 7], ["y", "z"], ["accepted", "bonus"], "yz"),
        Finished("length", 1.0, 2.0, 3, {}),
    ]
    m = compute_metrics(events)
    assert m["tokens_per_s"] == 1.0  # 2 tokens after prefill in 2 s
    assert m["overlap"] == 0.25  # both busy 1.5..2.0 out of 2 s
    assert m["target_idle_fraction"] == 0.25  # target idle 2.0..2.5
    assert m["draft_idle_fraction"] == 0.5
    assert m["mean_accepted_length"] == 1.0  # 3 tokens / 3 target forwards
    # the wall split: target alone 1.0..1.5 and 2.5..3.0, the draft alone 2.0..2.5, never neither
    assert (m["target_alone_fraction"], m["draft_alone_fraction"], m["neither_fraction"]) == (0.5, 0.25, 0.0)


def test_wall_split_of_a_serial_run():
    """SD's shape: the target waits on the draft, then the draft on the target, with a host gap between; the four
    shares of the decode wall (1.0..3.0 s) add up to 1."""
    spans = [
        TimingSpan("target", "prefill", 0, 0.0, 1.0),
        TimingSpan("draft", "draft", 1, 1.0, 1.4),
        TimingSpan("target", "verify", 1, 1.5, 2.0),
        TimingSpan("draft", "draft", 2, 2.0, 2.3),
        TimingSpan("target", "verify", 2, 2.3, 3.0),
    ]
    m = compute_metrics(spans + [TokensEmitted(0, [5], ["x"], ["target"], "x"), Finished("length", 1.0, 2.0, 1, {})])
    split = (m["overlap"], m["target_alone_fraction"], m["draft_alone_fraction"], m["neither_fraction"])
    assert split == (0.0, 0.6, 0.35, 0.05)  # target 0.5 + 0.7 s, draft 0.4 + 0.3 s, host 1.4..1.5 s
    assert m["target_idle_fraction"] == 0.4  # = draft alone + neither


def test_bad_event_dicts_are_refused():
    import pytest

    with pytest.raises(ValueError, match="unknown event type 'nope'"):
        from_dict({"type": "nope"})
    with pytest.raises(ValueError, match=r"event 'step_started' has unknown fields \['extra'\]"):
        from_dict({"type": "step_started", "step": 1, "position": 2, "t": 0.0, "extra": 1})


def test_acceptance_counts_only_verified_tokens():
    """Verification stops at the first rejection: tokens after it were never verified."""
    blocks = [
        Verified(1, 4, 1, [0.9, 0.1], [1.0, 1.0], [-1, -1], 7, "correction", 1.0),  # 1 accepted, 1 rejected
        Verified(2, 4, 4, [1.0] * 4, [1.0] * 4, [-1] * 4, 8, "bonus", 1.0),
    ]  # 4 accepted
    m = compute_metrics(blocks + [Finished("length", 0.0, 1.0, 7, {})])
    assert m["verified_tokens"] == 6 and m["accepted_tokens"] == 5
    assert m["acceptance_rate"] == round(5 / 6, 6)
    assert m["per_position_acceptance"] == [1.0, 0.5, 1.0, 1.0]  # position 2 is reached only by block 2
