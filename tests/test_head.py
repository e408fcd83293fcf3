"""The feature-conditioned draft head (engine/drafts/head.py) on tiny random-weight targets: its training-time
test attends exactly as drafting does, its cache rolls back by pointer and re-feeds stale rows, every
decoder stays lossless with it (greedy equality to the end of the context, chi-square when sampling),
`distill --kind head` trains one end to end, and a head for another target is refused at load."""

from __future__ import annotations

import json

import pytest
import torch

from engine.cli import main
from engine.config import GenerationConfig, SpecBranchError
from engine.drafts.head import FeatureHead, HeadLM, save_head
from engine.engine import Engine
from engine.models.loading import LM, load_model, load_pair
from engine.training.head_distill import losses, unrolled_outputs

from .conftest import make_tiny_model, seeded_schedule
from .reference import PROMPT, chi_square, exact_joint, transformers_model


def random_head(target, seed=0, scale=0.3):
    """A head whose weights are the target's last layer plus noise (so fc and the layer are not identities)."""
    torch.manual_seed(seed)
    head = FeatureHead.from_target(target, 1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp_min(0.05))
    return head.eval()


def quickly_trained_head(lm, steps=150):
    """A head trained for a few seconds on the target's own sampled text, so drafts are often accepted and
    the verification paths with accepted tokens run too."""
    torch.manual_seed(0)
    with torch.inference_mode():
        ids = lm.model.generate(torch.randint(2, 10, (32, 3)), do_sample=True, max_new_tokens=29, min_new_tokens=29)
        feats = lm.model.base_model(input_ids=ids).last_hidden_state
        embeds = lm.model.get_input_embeddings()(ids)
    head = FeatureHead.from_target(lm.model, 1).train()
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[:, -1] = False
    for _ in range(steps):
        loss, _ = losses(unrolled_outputs(head, embeds, feats, 2), feats, mask, lm.model.lm_head.weight, 0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("head") / "target", seed=1)
    model, tok = load_model(str(path), torch.device("cpu"), torch.float32)
    return path, LM(str(path), model, tok, model.config.vocab_size)


@pytest.fixture(scope="module")
def head_engine(tiny_target, tmp_path_factory):
    path, lm = tiny_target
    out = tmp_path_factory.mktemp("head") / "head"
    save_head(
        quickly_trained_head(lm),
        out,
        torch.arange(lm.vocab_size),
        {"hidden_size": 32, "vocab_size": lm.vocab_size, "target_layers": 2},
    )
    engine = Engine(load_pair(str(path), str(out), device="cpu"))
    yield engine
    engine.close()


def test_training_unroll_is_drafting(tiny_target):
    """Unroll step j of training predicts position t exactly as the head does when drafting at depth j+1:
    the target's features known up to t-j-1, its own predictions after that."""
    _, lm = tiny_target
    head = random_head(lm.model)
    ids = torch.tensor([[2, 5, 3, 7, 4, 4, 8, 2, 6, 3, 9, 5]])
    with torch.inference_mode():
        feats = lm.model.base_model(input_ids=ids).last_hidden_state
        outs = unrolled_outputs(head, lm.model.get_input_embeddings()(ids), feats, steps=3)
    hlm = HeadLM("h", head, lm, torch.arange(lm.vocab_size), lm.tokenizer)
    for j in range(3):
        for t in range(j, ids.shape[1]):
            cache = hlm.new_cache()
            cache.set_target_features(0, feats[0, : t - j])
            hlm.forward(ids[:, : t + 1], cache)
            assert torch.allclose(cache.pred[0, t], outs[j][0, t], atol=1e-5), (j, t)
            assert cache.built_on_pred[t] == (j > 0)


def test_head_cache_pointer_and_stale_rows(tiny_target):
    _, lm = tiny_target
    hlm = HeadLM("h", random_head(lm.model), lm, torch.arange(lm.vocab_size), lm.tokenizer)
    ids = torch.tensor([[2, 5, 3, 7, 4, 4]])
    with torch.inference_mode():
        feats = lm.model.base_model(input_ids=ids).last_hidden_state[0]
    cache = hlm.new_cache()
    cache.set_target_features(0, feats[:3])
    hlm.forward(ids, cache)  # rows 0..3 in one pass (true inputs), rows 4, 5 one by one on predictions
    assert cache.get_seq_length() == 6 and cache.built_on_pred == [False] * 4 + [True, True]
    assert cache.stale_from() == 6  # the target has not computed positions 3, 4 yet
    cache.set_target_features(3, feats[3:5])
    assert cache.stale_from() == 4  # row 4 was built on a prediction of f_3, now known
    with pytest.raises(ValueError, match="target features must arrive in order: have 5, got a start of 7"):
        cache.set_target_features(7, feats[:1])  # a gap
    cache.crop(-2)  # what engine.models.cache.rollback does
    assert cache.get_seq_length() == 4 and cache.kv.get_seq_length() == 4 and len(cache.built_on_pred) == 4
    again = hlm.forward(ids[:, 4:], cache)  # re-fed on true features: equals a fresh pass
    fresh = hlm.new_cache()
    fresh.set_target_features(0, feats[:5])
    assert torch.allclose(again, hlm.forward(ids, fresh)[:, 4:], atol=1e-5)


@pytest.mark.parametrize(
    "method, extra",
    [
        ("sd", dict(gamma=3)),
        ("pearl", dict(gamma=4)),
        ("specbranch", dict(gamma=4, branches=3, epsilon=1.0)),
        ("specbranch", dict(gamma=6, branches=2, epsilon=0.6, draft_stop=0.3)),
    ],
)
def test_head_greedy_equals_target_to_context_end(head_engine, method, extra):
    want = head_engine.run(PROMPT, GenerationConfig(method="ar", max_new_tokens=200)).token_ids
    r = head_engine.run(PROMPT, GenerationConfig(method=method, max_new_tokens=200, **extra))
    assert r.token_ids == want and r.finish_reason == "length"
    assert r.metrics["drafted_tokens"] > 0 and r.metrics["accepted_tokens"] > 0


@pytest.mark.parametrize(
    "method, extra",
    [
        ("pearl", dict(gamma=3)),
        ("specbranch", dict(gamma=3, branches=3, epsilon=1.0)),
    ],
)
@pytest.mark.slow
def test_head_sampled_follows_target(tiny_target, head_engine, method, extra, monkeypatch):
    """The first 3 tokens of 1,500 seeded runs against the target's exact distribution (transformers' own model,
    loaded apart from the engine's). How far the draft drafts beside each pass is drawn from the run's seed
    (conftest.seeded_schedule), so the outcome is the same on every run of the test."""
    seeded_schedule(monkeypatch)
    n = 1500
    counts: dict = {}
    for seed in range(n):
        r = head_engine.run(
            PROMPT, GenerationConfig(method=method, temperature=1.0, max_new_tokens=3, seed=seed, **extra)
        )
        counts[tuple(r.token_ids[:3])] = counts.get(tuple(r.token_ids[:3]), 0) + 1
    cfg = GenerationConfig(method=method, temperature=1.0)
    assert chi_square(counts, exact_joint(transformers_model(tiny_target[0]), PROMPT, 3, cfg, 10), n) > 1e-4


def test_head_for_another_target_is_refused(head_engine, tmp_path, tiny_target):
    path, _ = tiny_target
    head_dir = tmp_path / "head"
    deeper = make_tiny_model(tmp_path / "deeper", seed=1, layers=3)
    save_head(
        random_head(head_engine.pair.target.model),
        head_dir,
        torch.arange(10),
        {"hidden_size": 32, "vocab_size": 10, "target_layers": 2},
    )
    with pytest.raises(SpecBranchError, match="target_layers is 2, the target's is 3"):
        load_pair(str(deeper), str(head_dir), device="cpu")
    config = json.loads((head_dir / "config.json").read_text())
    config["specbranch_head"]["hidden_size"] = 64
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecBranchError, match="hidden_size is 64"):
        load_pair(str(path), str(head_dir), device="cpu")
    with pytest.raises(SpecBranchError, match="hf-assisted cannot take"):
        head_engine.run(PROMPT, GenerationConfig(method="hf-assisted", max_new_tokens=4))


def test_distill_head_tiny_end_to_end(tmp_path):
    target = make_tiny_model(tmp_path / "target", seed=5, layers=3, init=0.3, context=128)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": " ".join("abcdefgh"[(i * j) % 8] for j in range(1, 6)), "chat": False}) + "\n"
            for i in range(40)
        )
    )
    out = tmp_path / "head"
    code = main(
        [
            "distill",
            "--kind",
            "head",
            "--target",
            str(target),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--gen-batch-size",
            "8",
            "--layers",
            "1",
            "--unroll",
            "2",
            "--vocab",
            "8",
            "--epochs",
            "8",
            "--lr",
            "3e-3",
            "--batch-size",
            "8",
            "--val-fraction",
            "0.1",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    val = [r["val_agreement_by_depth"] for r in log if "val_agreement_by_depth" in r]
    assert len(val[-1]) == 2 and val[-1][0] > val[0][0] + 0.1  # it learns to agree with the target
    card = json.loads((out / "config.json").read_text())["specbranch_head"]
    assert card["kind"] == "head" and card["unroll"] == 2 and card["target_layers"] == 3
    engine = Engine(load_pair(str(target), str(out), device="cpu"))
    assert isinstance(engine.pair.draft, HeadLM)
    want = engine.run([2, 3, 4], GenerationConfig(method="ar", max_new_tokens=40)).token_ids
    for method in ("sd", "specbranch"):
        r = engine.run([2, 3, 4], GenerationConfig(method=method, max_new_tokens=40, gamma=4))
        assert r.token_ids == want and r.metrics["acceptance_rate"] > 0
    engine.close()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kind", "bogus"], "invalid choice"),
        (["--kind", "head", "--unroll", "0"], "--unroll must be >= 1"),
    ],
)
def test_distill_head_bad_input_before_loading(tmp_path, capsys, argv, message):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3]}) + "\n")
    try:
        code = main(
            [
                "distill",
                "--target",
                str(tmp_path / "no-such-model"),
                "--corpus",
                str(corpus),
                "--out",
                str(tmp_path / "o"),
                "--work-dir",
                str(tmp_path / "w"),
                *argv,
            ]
        )
    except SystemExit as exc:  # argparse refuses unknown choices itself
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err
