"""`python -m engine costs`: the forward-cost measurement runs on a real (tiny) pair, and the modelled
speedups follow the formulas in engine/measure/costs.py, checked on a hand-made bench report."""

from __future__ import annotations

import json

import pytest

from engine.cli import main
from engine.measure.costs import modelled


def agg(
    tokens_per_s, speedup, tau, verify_ms, target_forwards=10, draft_forwards=0, draft_ms=None, prompts=1, wasted=None
):
    return {
        "tokens_per_s": tokens_per_s,
        "speedup_vs_ar": speedup,
        "mean_accepted_length": tau,
        "target_forward_ms": verify_ms,
        "target_forwards": target_forwards,
        "draft_forwards": draft_forwards,
        "draft_forward_ms": draft_ms,
        "prompts": prompts,
        "acceptance_rate": 0.5,
        "per_position_acceptance": [],
        "wasted_draft_rate": wasted,
    }


def test_modelled_speedups_by_hand():
    report = {
        "results": {
            "ar": {"all": agg(20.0, 1.0, 1.0, 50.0)},
            # sd: 11 target forwards, 1 of them the prefill: 10 rounds, 40 draft steps of 10 ms -> d = 4
            # modelled = 2.0 * 50 / (80 + 4 * 10) = 0.8333; half the drafted tokens wasted: 2.0 * 50 / (80 + 20) = 1
            "sd": {"all": agg(16.0, 0.8, 2.0, 80.0, target_forwards=11, draft_forwards=40, draft_ms=10.0, wasted=0.5)},
            # overlapped: the draft hides behind the target (11 passes, 10 rounds, 30 steps of 10 ms: 30 ms < 75 ms):
            # 2.5 * 50 / 75 = 1.6667; measured 1.2 -> share 0.72; its waste costs no time
            "specbranch@embedded": {
                "all": agg(24.0, 1.2, 2.5, 75.0, target_forwards=11, draft_forwards=30, draft_ms=10.0, wasted=0.5)
            },
            # the draft is the slower one (6 steps of 30 ms a round: 180 ms > 100 ms): 5.0 * 50 / 180 = 1.3889;
            # a quarter wasted: 5.0 * 50 / 135 = 1.8519; a tenth: 5.0 * 50 / 162 = 1.5432 (headroom 1 / 0.9)
            "pearl@self": {
                "all": agg(26.0, 1.3, 5.0, 100.0, target_forwards=11, draft_forwards=60, draft_ms=30.0, wasted=0.25)
            },
            "pearl": {
                "all": agg(26.0, 1.3, 5.0, 100.0, target_forwards=11, draft_forwards=60, draft_ms=30.0, wasted=0.1)
            },
            "hf-assisted": {"all": agg(10.0, 0.5, None, None)},
        }
    }
    rows = modelled(report)
    assert rows["ar"]["modelled"] == 1.0
    assert rows["sd"]["modelled"] == pytest.approx(0.833, abs=1e-3)
    assert rows["specbranch@embedded"]["modelled"] == pytest.approx(1.667, abs=1e-3)
    assert rows["specbranch@embedded"]["share_of_limit"] == pytest.approx(0.72, abs=1e-3)
    assert rows["pearl@self"]["modelled"] == pytest.approx(1.389, abs=1e-3)
    assert rows["hf-assisted"]["modelled"] is None  # its forwards are invisible to us
    # which model sets a round, and the limit with no drafted token wasted
    assert [rows[m]["pace"] for m in ("ar", "sd", "specbranch@embedded", "pearl@self", "hf-assisted")] == [
        None,
        "serial",
        "target",
        "draft",
        None,
    ]
    assert rows["sd"]["no_waste"] == pytest.approx(1.0, abs=1e-3)
    assert rows["specbranch@embedded"]["no_waste"] == rows["specbranch@embedded"]["modelled"]
    assert rows["pearl@self"]["no_waste"] == pytest.approx(1.852, abs=1e-3)
    assert rows["pearl"]["no_waste"] / rows["pearl"]["modelled"] == pytest.approx(1 / 0.9, abs=1e-3)
    assert rows["hf-assisted"]["no_waste"] is None


def test_costs_command_on_a_tiny_pair(tiny_dirs, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps({"results": {"ar": {"all": agg(20.0, 1.0, 1.0, 50.0)}, "pearl": {"all": agg(30.0, 1.5, 2.0, 60.0)}}})
    )
    out = tmp_path / "costs.json"
    code = main(
        [
            "costs",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--device",
            "cpu",
            "--context",
            "16",
            "--max-tokens",
            "3",
            "--max-rows",
            "2",
            "--reps",
            "3",
            "--bench",
            str(bench),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    forwards = result["forwards"]
    assert sorted(forwards["target_ms_by_tokens"]) == ["1", "2", "3"] and sorted(forwards["draft_ms_by_rows"]) == [
        "1",
        "2",
    ]
    assert all(v > 0 for v in forwards["target_ms_by_tokens"].values()) and forwards["c"] > 0
    assert sorted(forwards["target_ms_beside_draft_rows"]) == ["1", "2"]
    assert all(v > 0 for v in forwards["target_ms_beside_draft_rows"].values())
    assert result["model"]["all"]["pearl"]["modelled"] == pytest.approx(2.0 * 50 / 60, abs=1e-3)


def test_model_only_reads_a_bench_without_loading_a_model(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "results": {
                    "ar": {"all": agg(20.0, 1.0, 1.0, 50.0)},
                    "pearl": {
                        "all": agg(
                            26.0, 1.3, 5.0, 100.0, target_forwards=11, draft_forwards=60, draft_ms=30.0, wasted=0.1
                        )
                    },
                }
            }
        )
    )
    out = tmp_path / "model.json"
    # a target that cannot load: --model-only never tries
    assert (
        main(
            [
                "costs",
                "--target",
                str(tmp_path / "no-such-model"),
                "--bench",
                str(bench),
                "--model-only",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert "forwards" not in result and result["bench"] == str(bench)
    assert result["model"]["all"]["pearl"]["pace"] == "draft"
    assert result["model"]["all"]["pearl"]["no_waste"] == pytest.approx(1.543, abs=1e-3)
    assert "| draft | 1.54 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, why",
    [
        (["--model-only"], "name one with --bench"),
        (["--bench", "{missing}"], "cannot read bench report"),
        (["--bench", "{not_bench}"], "is not a bench report"),
        (["--bench", "{not_bench}", "--model-only"], "is not a bench report"),
    ],
)
def test_costs_refuses_a_missing_or_foreign_bench_before_loading(tmp_path, capsys, args, why):
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    paths = {"missing": tmp_path / "missing.json", "not_bench": tmp_path / "other.json"}
    args = [a.format(**paths) for a in args]
    # the target named cannot load, so a refusal that came after loading would say so instead
    assert main(["costs", "--target", str(tmp_path / "no-such-model"), *args]) == 2
    assert why in capsys.readouterr().err


def test_costs_are_the_engine_workers_own_spans(tiny_dirs, monkeypatch):
    """Every forward `costs` and --branch-costs time runs on its model's engine worker, and the figures reported are
    medians of those workers' spans (on CUDA their events on their own streams; on a CPU host clocks around the
    call), not clocks of their own around a call on the caller's thread."""
    import statistics

    from engine.engine import Engine
    from engine.measure import costs
    from engine.models.loading import load_pair
    from engine.runtime import Worker

    spans = []
    real = Worker.run

    async def run(self, fn, *args, **kwargs):  # the real run, its spans kept
        result, span = await real(self, fn, *args, **kwargs)
        spans.append(span)
        return result, span

    monkeypatch.setattr(Worker, "run", run)
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32"))
    try:
        out = costs.measure(engine, context=16, max_tokens=3, max_rows=2, reps=3)
        ms = lambda group: round(1000 * statistics.median(s.end - s.start for s in group), 3)  # noqa: E731
        target = [s for s in spans if s.worker == "target" and s.kind == costs.COSTS]
        draft = [s for s in spans if s.worker == "draft" and s.kind == costs.COSTS]
        assert len(target) == 3 + 3 * 3 and len(draft) == 2 + 3 * 2  # one warm-up per width, then 3 reps in turn
        assert out["target_ms_by_tokens"] == {w: ms(target[3:][w - 1 :: 3]) for w in (1, 2, 3)}
        assert out["draft_ms_by_rows"] == {k: ms(draft[2:][k - 1 :: 2]) for k in (1, 2)}
        spans.clear()
        measured = engine.branch_costs(2, rounds=1)
        draft = [s for s in spans if s.worker == "draft"]
        target = [s for s in spans if s.worker == "target"]
        assert measured.draft_ms == {k: ms(draft[2 : 2 + 15 * 2][k - 1 :: 2]) for k in (1, 2)}
        # each target step beside k draft rows: one warm-up and 5 timed, while the draft's worker stepped beside it
        assert len(target) == 2 * 6 and len(draft) >= 2 + 15 * 2 + 2
        assert measured.target_busy_ms == {1: ms(target[1:6]), 2: ms(target[7:12])}
    finally:
        engine.close()
