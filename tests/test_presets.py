"""One set of defaults: the CLI, the bench and the app read each draft's settings from engine/presets.py, and every
flag still overrides its preset."""

from __future__ import annotations

import json

import pytest

from app.settings import defaults_for, make_config
from engine.cli import generation_config, main, parse
from engine.kernels.lm_head import int4_supported
from engine.presets import DISTILLED, OFTEN_WRONG, SCENARIOS, SELF, default_draft, draft_forward, preset_for


def test_each_draft_kind_has_its_preset():
    assert preset_for("self") is SELF
    assert preset_for("embedded-weak") is preset_for("self-skip:3,4,5,25") is OFTEN_WRONG
    assert preset_for("embedded") is preset_for("embedded-head") is preset_for("/a/draft/dir") is DISTILLED
    assert preset_for(None) is DISTILLED
    assert set(SCENARIOS) == {"fastest", "rescue", "weak"}
    assert SCENARIOS["fastest"].draft == "self" and SCENARIOS["weak"].draft == "embedded-weak"
    # branches rescue in the paper's regime: the distilled draft, whose preset the scenario keeps
    assert (SCENARIOS["rescue"].draft, SCENARIOS["rescue"].preset) == ("embedded", preset_for("embedded"))


def test_the_default_draft_is_the_fastest_this_machine_supports():
    # the 4-bit self-draft needs the int4 kernel on a float32 CPU target (a stated check, not a caught error)
    assert default_draft("cpu") == ("self" if int4_supported() else "embedded")


def test_the_cli_starts_from_the_drafts_preset(monkeypatch):
    """No flag: the draft is the machine's default and its preset gives every setting; the draft's forward is the
    app's (lean-compiled) unless the environment says otherwise."""
    monkeypatch.delenv("SPECBRANCH_DRAFT_FORWARD", raising=False)
    args = parse(["bench", "--methods", "ar,specbranch", "--device", "cpu"])
    assert args.draft == default_draft("cpu") and args.draft_forward == draft_forward() == "lean-compiled"
    cfg = generation_config(args, "specbranch")
    for key, value in preset_for(args.draft).settings().items():
        assert getattr(cfg, key) == value, key
    monkeypatch.setenv("SPECBRANCH_DRAFT_FORWARD", "transformers")
    assert parse(["generate", "--device", "cpu"]).draft_forward == "transformers"
    assert parse(["generate", "--draft-forward", "lean"]).draft_forward == "lean"


def test_every_flag_overrides_its_preset():
    args = parse(
        [
            "generate",
            "--draft",
            "self",
            "--gamma",
            "2",
            "--epsilon",
            "0.7",
            "--draft-stop",
            "0.4",
            "--feed-stop",
            "0.2",
            "--head-start",
            "0.5",
            "--hold",
            "0.3",
            "--hold-branches",
            "--hrad",
        ]
    )
    cfg = generation_config(args, "specbranch")
    assert (cfg.gamma, cfg.epsilon, cfg.draft_stop, cfg.feed_stop, cfg.head_start, cfg.hold) == (
        2,
        0.7,
        0.4,
        0.2,
        0.5,
        0.3,
    )
    assert cfg.hold_branches is True and cfg.hrad is True
    # a flag set to the value another preset has is kept when another draft's preset fills the rest
    other = generation_config(args, "specbranch", "embedded")
    assert other == cfg
    assert generation_config(parse(["generate", "--draft", "self", "--no-hrad"]), "specbranch").hrad is False


def test_a_bench_entry_with_another_draft_takes_that_drafts_preset():
    args = parse(["bench", "--draft", "self", "--gamma", "5"])
    cfg = generation_config(args, "specbranch", "embedded")
    assert cfg.gamma == 5  # the flag
    assert (cfg.epsilon, cfg.draft_stop, cfg.hold) == (DISTILLED.epsilon, DISTILLED.draft_stop, DISTILLED.hold)
    assert generation_config(args, "specbranch").epsilon == SELF.epsilon


def test_bench_records_each_entrys_settings(capsys, tiny_dirs, tmp_path):
    """`bench` with no setting flags: each entry runs with its draft's preset, and the report says which."""
    prompts = tmp_path / "b.jsonl"
    prompts.write_text('{"prompt": "a b", "chat": false}\n')
    out = tmp_path / "bench.json"
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
                "6",
                "--warmup",
                "0",
                "--draft-worker",
                "thread",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    for key, value in DISTILLED.settings().items():  # a draft directory is a distilled draft
        assert report["settings_by_method"]["specbranch"][key] == value, key
        assert report["settings"][key] == value, key


def test_the_app_starts_from_the_same_presets():
    assert defaults_for("self") == SELF.settings() and defaults_for("embedded-weak") == OFTEN_WRONG.settings()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("gamma", 2.5, "γ must be a whole number, got 2.5"),
        ("max_new", float("inf"), "max new tokens must be a whole number, got inf"),
        ("seed", "x", "seed must be a number, got 'x'"),
    ],
)
def test_the_apps_integer_controls_refuse_fractions_and_infinities(field, value, message):
    from engine.config import SpecBranchError

    values = dict(
        method="sd",
        max_new=8,
        temperature=0,
        top_p=1,
        gamma=3,
        branches=3,
        epsilon=0.5,
        draft_stop=0,
        feed_stop=0,
        head_start=0,
        hold=0,
        hold_branches=False,
        hrad=False,
        seed=0,
    )
    with pytest.raises(SpecBranchError, match=message):
        make_config(**{**values, field: value})
    big = 2**62 - 1  # a seed larger than a float holds exactly stays exact
    assert make_config(**{**values, "seed": big}).seed == big
    assert make_config(**{**values, "max_new": 8.0}).max_new_tokens == 8
