"""H-RAD on tiny random-weight models: its samples' features, confidences and labels against a
response with known accepted runs, the features the engine reads at run time, training end to end,
and the refusals (weights for another pair, no usable rows); collected samples are reused only for the
weights and settings they were collected with."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.cli import main
from engine.config import GenerationConfig
from engine.engine import Engine
from engine.events import Notice
from engine.methods.hrad import HRAD, pair_signature, save_hrad
from engine.models.loading import load_pair
from engine.training.common import split_by_prompt
from engine.training.hrad import (
    Sample,
    evaluate,
    forced_samples,
    load_samples,
    macro_f1,
    samples_key,
    save_samples,
    train_classifier,
)

PROMPT = [2, 3, 4]


def hf_logits(lm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(torch.tensor([ids])).logits[0].float()


def draft_greedy(pair, ids: list[int]) -> int:
    return int(hf_logits(pair.draft, ids).argmax(-1)[-1])


def response_with_runs(pair, runs: list[int]) -> tuple[list[int], list[int]]:
    """A response where, after each token the draft mispredicts, it then predicts exactly `runs[i]` tokens
    in a row; returns (response, indices of the mispredicted tokens)."""
    response = [draft_greedy(pair, PROMPT)]
    misses = []
    for run in runs + [0]:  # a last miss ends the last run, so that its length is known
        guess = draft_greedy(pair, PROMPT + response)
        misses.append(len(response))
        response.append((guess + 1 + len(misses)) % 10 or 2)  # any token but the draft's guess
        if response[-1] == guess:
            response[-1] = (guess + 1) % 10
        for _ in range(run):
            response.append(draft_greedy(pair, PROMPT + response))
    return response, misses


def test_samples_have_known_labels_features_and_confidence(tiny_engine):
    pair = tiny_engine.pair
    runs = [2, 0, 5, 3, 1]
    response, misses = response_with_runs(pair, runs)
    samples = forced_samples(pair, PROMPT, response, horizon=4, prompt=7)
    # one sample per mispredicted token; the last one's run reaches the end of the response: dropped
    assert [s.label for s in samples] == [1, 0, 2, 1, 1]
    assert {s.prompt for s in samples} == {7}
    ids = PROMPT + response
    with torch.inference_mode():
        hidden = pair.target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        emb = pair.target.model.get_input_embeddings().weight
    confidence = hf_logits(pair.draft, ids).softmax(-1).amax(-1)
    for s, t in zip(samples, misses):
        at = len(PROMPT) + t - 1  # the target's state at the token before the mispredicted one
        want = torch.cat([h[0, at] for h in hidden[-4:]] + [emb[ids[at + 1]]])
        torch.testing.assert_close(s.features, want, atol=1e-4, rtol=1e-4)
        assert s.confidence == pytest.approx(float(confidence[at + 1]), abs=1e-5)


def test_engine_reads_the_same_features_it_was_trained_on(tiny_engine):
    """At run time H-RAD sees the target's state at the last verified token, emb(last committed token)
    and the draft's confidence in its first token after the verdict: the same as the samples."""
    raw: list = []
    r = tiny_engine.run(PROMPT, GenerationConfig(method="pearl", max_new_tokens=30, gamma=3), collect_hrad=raw)
    assert raw, "a 30-token run with a random draft has rejections"
    ids = PROMPT + r.token_ids
    with torch.inference_mode():
        hidden = tiny_engine.pair.target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        emb = tiny_engine.pair.target.model.get_input_embeddings().weight
    confidence = hf_logits(tiny_engine.pair.draft, ids).softmax(-1).amax(-1)
    for index, feats, conf in raw:
        at = len(PROMPT) + index - 1
        want = torch.cat([h[0, at] for h in hidden[-4:]] + [emb[ids[at + 1]]])
        torch.testing.assert_close(feats, want, atol=1e-4, rtol=1e-4)
        assert conf == pytest.approx(float(confidence[at + 1]), abs=1e-5)


def test_macro_f1_and_split_by_prompt():
    gold = torch.tensor([0, 0, 1, 2])
    pred = torch.tensor([0, 1, 1, 1])
    # class 0: tp 1, |pred| 1, |gold| 2 -> 2/3; class 1: tp 1, 3 + 1 -> 1/2; class 2: 0
    assert macro_f1(pred, gold) == pytest.approx((2 / 3 + 1 / 2 + 0) / 3)
    samples = [Sample(p, torch.zeros(3), 0.5, p % 3) for p in range(10) for _ in range(4)]
    train, val = split_by_prompt(samples, 0.2, seed=0, prompt_of=lambda s: s.prompt)
    assert len(val) == 8 and not {s.prompt for s in train} & {s.prompt for s in val}


def test_classifier_learns_a_separable_rule():
    """The projection keeps the direction that decides the class; the MLP learns it, beats majority."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(600):
        x = torch.randn(40, generator=g)
        samples.append(Sample(i // 10, x, 0.5, 0 if x[3] < -0.5 else (2 if x[3] > 0.5 else 1)))
    train, val = split_by_prompt(samples, 0.2, seed=0, prompt_of=lambda s: s.prompt)
    model = train_classifier(train, epochs=40, proj_dim=40, hidden=32, dropout=0.0)
    report = evaluate(model, train, {"val": val})
    assert report["val"]["hrad"]["accuracy"] >= 0.8 > 0.5 > report["val"]["majority"]["accuracy"]
    # confidence carries nothing here: the confidence-only rule cannot do better than one class
    assert report["val"]["confidence_only"]["macro_f1"] < 0.5


def copy_of_draft(tiny_dirs, tmp_path):
    path = tmp_path / "draft"
    shutil.copytree(tiny_dirs["draft"], path)
    return path


def test_weights_for_another_pair_are_refused_with_a_notice(tiny_dirs, tiny_engine, tmp_path):
    draft = copy_of_draft(tiny_dirs, tmp_path)
    other = pair_signature(tiny_engine.pair)
    other["draft"] = {**other["draft"], "num_hidden_layers": 6}
    save_hrad(HRAD(5 * 32), draft / "hrad.safetensors", {"pair": other})
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(draft), device="cpu"))
    try:
        assert engine.hrad is None
        assert "another draft: num_hidden_layers 6 (this draft: 2)" in engine.hrad_notice
        r = engine.run(PROMPT, GenerationConfig(method="specbranch", max_new_tokens=6, hrad=True))
        notices = [e.message for e in r.events if isinstance(e, Notice)]
        assert any("H-RAD off" in m and "another draft" in m for m in notices)
    finally:
        engine.close()


def test_old_format_weights_are_refused(tiny_dirs, tiny_engine, tmp_path):
    from safetensors.torch import save_file

    draft = copy_of_draft(tiny_dirs, tmp_path)
    save_file({"net.1.weight": torch.zeros(64, 160)}, str(draft / "hrad.safetensors"))
    (draft / "hrad.json").write_text(json.dumps({"in_dim": 160}))
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(draft), device="cpu"))
    try:
        assert engine.hrad is None and "train-hrad" in engine.hrad_notice
    finally:
        engine.close()


def test_train_hrad_without_usable_rows_exits_2(tiny_dirs, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"prompt_ids": [2, 3]}) + "\n")  # no response: nothing to label
    code = main(
        [
            "train-hrad",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--corpus",
            str(corpus),
            "--out",
            str(tmp_path / "h.safetensors"),
            "--device",
            "cpu",
        ]
    )
    assert code == 2
    assert "0 usable rows" in capsys.readouterr().err
    assert not (tmp_path / "h.safetensors").exists()


def test_train_hrad_end_to_end_loads_and_stays_lossless(tiny_dirs, tiny_engine, tmp_path):
    prompts = [[2 + i % 7, 3 + i % 5, 4] for i in range(8)]
    rows = [
        {
            "source": "tiny",
            "prompt_ids": p,
            "response_ids": tiny_engine.run(p, GenerationConfig(method="ar", max_new_tokens=30)).token_ids,
        }
        for p in prompts
    ]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    draft = copy_of_draft(tiny_dirs, tmp_path)
    code = main(
        [
            "train-hrad",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(draft),
            "--device",
            "cpu",
            "--corpus",
            str(corpus),
            "--limit",
            "8",
            "--held-out-limit",
            "0",
            "--epochs",
            "3",
            "--samples",
            str(tmp_path / "s.pt"),
            "--out",
            str(draft / "hrad.safetensors"),
        ]
    )
    assert code == 0
    card = json.loads((draft / "hrad.json").read_text())
    assert card["pair"]["draft"]["num_hidden_layers"] == 2
    assert card["validation_by_prompt"]["samples"] > 0
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(draft), device="cpu"))
    try:
        assert engine.hrad is not None, engine.hrad_notice
        for p in prompts[:3]:
            want = engine.run(p, GenerationConfig(method="ar", max_new_tokens=25)).token_ids
            assert (
                engine.run(p, GenerationConfig(method="specbranch", max_new_tokens=25, gamma=3, hrad=True)).token_ids
                == want
            )
    finally:
        engine.close()


def test_saved_samples_are_reused_only_for_the_same_weights_and_settings(tiny_dirs, tmp_path):
    """A draft retrained in place keeps its shapes (pair_signature cannot tell), so the samples cache is keyed
    by a digest of both models' weights and by the collection settings."""
    pair = load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu")
    key = samples_key(pair, {"limit": 8, "horizon": 4})
    sets = {"train": [Sample(p, torch.randn(5), 0.25 * p, p % 3) for p in range(4)], "held_out": []}
    path = tmp_path / "s.pt"
    save_samples(path, sets, key)
    back = load_samples(path, samples_key(pair, {"limit": 8, "horizon": 4}))
    assert [(s.prompt, s.confidence, s.label) for s in back["train"]] == [
        (s.prompt, s.confidence, s.label) for s in sets["train"]
    ]
    torch.testing.assert_close(back["train"][0].features, sets["train"][0].features.half().float())
    assert load_samples(path, samples_key(pair, {"limit": 9, "horizon": 4})) is None  # other settings
    with torch.no_grad():  # the same draft, one weight changed: what retraining it in place does
        next(pair.draft.model.parameters())[0, 0] += 1.0
    assert pair_signature(pair) == pair_signature(
        load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu")
    )
    assert load_samples(path, samples_key(pair, {"limit": 8, "horizon": 4})) is None
    torch.save({"train": {}}, path)  # a cache from before the key
    assert load_samples(path, key) is None
