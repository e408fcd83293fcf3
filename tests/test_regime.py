"""The regime map (engine/measure/regime.py, docs/results/tools/regime_map.py) from a real bench run of two drafts on
the tiny pair, and its drawing in the "How to read this" tab (app/regime.py), escaped, from the committed map."""

from __future__ import annotations

import json

import pytest

from app.regime import MAP, load_map, regime_figure, regime_table
from engine.cli import main
from engine.measure.regime import ALPHAS, regime_map, tokens_a_pass

DRAFTS = ("truncated:1", "DIR")  # the tiny target's first layer, and the tiny draft's directory


@pytest.fixture(scope="module")
def report(tiny_dirs, tmp_path_factory) -> dict:
    """One bench run: ar, then sd, pearl and specbranch with each draft (METHOD@DRAFT), on two raw prompts."""
    tmp = tmp_path_factory.mktemp("regime")
    prompts, out = tmp / "p.jsonl", tmp / "bench.json"
    prompts.write_text('{"prompt": "a b", "chat": false}\n{"prompt": "c d e", "chat": false}\n')
    specs = {"truncated:1": "truncated:1", "DIR": str(tiny_dirs["draft"])}
    methods = ["ar"] + [f"{m}@{specs[d]}" for d in DRAFTS for m in ("sd", "pearl", "specbranch")]
    argv = ["bench", "--target", str(tiny_dirs["target"]), "--device", "cpu", "--draft-worker", "thread"]
    argv += ["--methods", ",".join(methods), "--dataset", str(prompts), "--max-new-tokens", "12", "--json", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_tokens_a_pass_is_the_accepted_prefix_plus_the_targets_token():
    assert tokens_a_pass(0.0, 3) == 1 and tokens_a_pass(1.0, 3) == 4
    assert tokens_a_pass(0.5, 2) == pytest.approx(1.75)


def test_every_draft_has_its_c_alpha_and_each_methods_curve(report):
    data = regime_map(report)
    t_ar = report["results"]["ar"]["all"]["target_forward_ms"]
    assert len(data["drafts"]) == 2 and data["bench_command"] == report["command"]
    for draft, entry in data["drafts"].items():
        sd = report["results"][f"sd@{draft}"]["all"]
        assert entry["alpha"] == sd["acceptance_rate"]
        assert entry["c"] == pytest.approx(t_ar / sd["draft_forward_ms"], abs=0.01)
        assert set(entry["methods"]) == {"sd", "pearl", "specbranch"}
        for method, m in entry["methods"].items():
            assert m["measured"] == report["results"][f"{method}@{draft}"]["all"]["speedup_vs_ar"]
            assert len(m["curve"]) == len(ALPHAS) and m["curve"] == sorted(m["curve"])  # more accepted, faster
            # the curve's round is the one costs.modelled divides by: at any α the two differ by τ(α) / τ measured
            i = len(ALPHAS) // 2
            want = m["modelled"] * tokens_a_pass(ALPHAS[i], m["gamma"]) / m["tau"]
            assert m["curve"][i] == pytest.approx(want, rel=0.01)


def test_a_draft_without_an_sd_run_is_refused(report):
    cut = {**report, "results": {k: v for k, v in report["results"].items() if not k.startswith("sd@truncated")}}
    with pytest.raises(ValueError, match="no sd run for truncated:1"):
        regime_map(cut)


def test_the_figure_and_table_escape_what_the_file_says(report, tmp_path):
    data = regime_map(report)
    hostile = "<img src=x onerror=alert(1)>"
    data["drafts"][hostile] = data["drafts"].pop("truncated:1")
    path = tmp_path / "map.json"
    path.write_text(json.dumps(data))
    loaded, why = load_map(path)
    assert why == "" and loaded is not None
    fig = regime_figure(loaded)
    names = [t.name for t in fig.data] + [t.hovertemplate for t in fig.data]
    assert not any("<img" in n for n in names) and any("&lt;img" in n for n in names)
    assert "<img" not in regime_table(loaded) and "&lt;img" in regime_table(loaded)
    # markers: one per (draft, method) measured; lines: one per curve
    assert sum(t.mode == "markers" for t in fig.data) == 6 and sum(t.mode == "lines" for t in fig.data) == 6


@pytest.mark.parametrize("text", ["", "{", '{"drafts": 3, "alphas": [0.1]}', '{"drafts": {}, "alphas": ["x"]}'])
def test_a_bad_map_file_is_said_not_raised(tmp_path, text):
    path = tmp_path / "map.json"
    path.write_text(text)
    data, why = load_map(path)
    assert data is None and why.startswith("no regime map to draw (map.json")


def test_the_committed_map_holds_every_shipped_draft():
    """The map the app draws: each draft the README's table ships beside the target, with its c, α and the three
    methods' measured speeds and curves."""
    data, why = load_map(MAP)
    assert data is not None, why
    assert {"self", "embedded", "embedded-weak", "embedded-head"} <= set(data["drafts"])
    for entry in data["drafts"].values():
        assert entry["c"] > 0 and 0 < entry["alpha"] <= 1
        assert all(entry["methods"][m]["measured"] > 0 for m in ("sd", "pearl", "specbranch"))
