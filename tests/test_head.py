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
from engine.kernels.lm_head import bf16_supported
from engine.models.loading import LM, load_model, load_pair, pair_of
from engine.training.head_distill import (
    FeatureStore,
    HeadSettings,
    Rows,
    extract_features,
    losses,
    train_head,
    unrolled_outputs,
)

from .conftest import make_tiny_model, seeded_schedule
from .reference import PROMPT, chi_square, exact_joint, transformers_model

FUSED = (0, 1, 2)  # the tiny 2-layer target's embeddings, first layer's output and final-norm state


def random_head(target, seed=0, scale=0.3, feature_layers=None):
    """A head whose weights are the target's last layer plus noise (so fc and the layer are not identities)."""
    torch.manual_seed(seed)
    head = FeatureHead.from_target(target, 1, feature_layers=feature_layers)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp_min(0.05))
    return head.eval()


def side_by_side(model, ids, layers) -> torch.Tensor:
    """The reference for what a fused head reads: transformers' own hidden states `layers`, concatenated [B, T, k H]."""
    with torch.inference_mode():
        hidden = model.base_model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden[i] for i in layers], dim=-1)


def quickly_trained_head(lm, steps=150, feature_layers=None):
    """A head trained for a few seconds on the target's own sampled text, so drafts are often accepted and
    the verification paths with accepted tokens run too."""
    torch.manual_seed(0)
    with torch.inference_mode():
        ids = lm.model.generate(torch.randint(2, 10, (32, 3)), do_sample=True, max_new_tokens=29, min_new_tokens=29)
        feats = lm.model.base_model(input_ids=ids).last_hidden_state
        embeds = lm.model.get_input_embeddings()(ids)
    raw = side_by_side(lm.model, ids, feature_layers) if feature_layers else feats
    head = FeatureHead.from_target(lm.model, 1, feature_layers=feature_layers).train()
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[:, -1] = False
    reg = 0.0 if feature_layers else 0.5
    for _ in range(steps):
        loss, _ = losses(unrolled_outputs(head, embeds, raw, 2), feats, mask, lm.model.lm_head.weight, reg)
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


@pytest.fixture(scope="module")
def fused_engine(tiny_target, tmp_path_factory):
    path, lm = tiny_target
    out = tmp_path_factory.mktemp("head") / "fused"
    head = quickly_trained_head(lm, feature_layers=FUSED)
    save_head(head, out, torch.arange(lm.vocab_size), {"hidden_size": 32, "vocab_size": lm.vocab_size})
    engine = Engine(load_pair(str(path), str(out), device="cpu"))
    yield engine
    engine.close()


def assert_drafting_matches(hlm, ids: torch.Tensor, feats: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """At each depth j+1 and position t, the head drafting with the target's features known up to t-j-1 predicts
    what training's unroll step j predicted there, built on its own predictions past them."""
    for j in range(len(outs)):
        for t in range(j, ids.shape[1]):
            cache = hlm.new_cache()
            cache.set_target_features(0, feats[0, : t - j])
            hlm.forward(ids[:, : t + 1], cache)
            assert torch.allclose(cache.pred[0, t], outs[j][0, t], atol=1e-5), (j, t)
            assert cache.built_on_pred[t] == (j > 0)


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
    assert_drafting_matches(hlm, ids, feats, outs)


def test_fused_training_unroll_is_drafting(tiny_target):
    """The same for a head fusing several of the target's layers (EAGLE-3): training reads them side by side and
    fuses them; drafting is handed them by the target's own forward (LM.forward features=True, which gives exactly
    transformers' hidden states side by side) and fuses them in its cache."""
    _, lm = tiny_target
    head = random_head(lm.model, feature_layers=FUSED)
    ids = torch.tensor([[2, 5, 3, 7, 4, 4, 8, 2, 6, 3, 9, 5]])
    raw = side_by_side(lm.model, ids, FUSED)  # [1, T, 3 H]
    with torch.inference_mode():
        outs = unrolled_outputs(head, lm.model.get_input_embeddings()(ids), raw, steps=3)
    pair = pair_of(lm, "fused", head, lm.tokenizer, torch.arange(lm.vocab_size))
    target, hlm = pair.target, pair.draft
    assert target.feature_layers == FUSED and lm.feature_layers is None  # the pair's own view of the target
    handed = target.forward(ids, target.new_cache(), features=True).features
    assert torch.allclose(handed, raw, atol=1e-5) and handed.shape[-1] == 3 * lm.model.config.hidden_size
    assert_drafting_matches(hlm, ids, handed, outs)


@pytest.mark.parametrize("static", [True, False])
def test_target_features_are_the_named_hidden_states(tiny_target, static):
    """LM.forward(features=True) hands over the hidden states feature_layers names, side by side, on the static path
    and on transformers' forward alike, in a prefill and in a later pass; without them, the final-norm state."""
    path, lm = tiny_target
    target = LM(str(path), lm.model, lm.tokenizer, lm.vocab_size, static=static)
    assert target.static == static
    ids = torch.tensor([[2, 5, 3, 7, 4, 4, 8]])
    want = side_by_side(lm.model, ids, (1, 0, 2))
    target.feature_layers = (1, 0, 2)
    cache = target.new_cache()
    first = target.forward(ids[:, :4], cache, features=True)
    later = target.forward(ids[:, 4:], cache, features=True)
    assert first.hidden_states is None  # computed for the features only
    assert torch.allclose(torch.cat([first.features, later.features], 1), want, atol=1e-5)
    target.feature_layers = None
    plain = target.forward(ids, target.new_cache(), features=True).features
    assert torch.allclose(plain, want[..., -32:], atol=1e-5)


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
        ("sd", dict(gamma=3)),
        ("pearl", dict(gamma=4)),
        ("specbranch", dict(gamma=6, branches=2, epsilon=0.6, draft_stop=0.3)),
    ],
)
def test_fused_head_greedy_equals_target_to_context_end(fused_engine, method, extra):
    """A fused head, saved and loaded by its spec: the target hands it its layers, and the output stays the target's."""
    assert fused_engine.pair.draft.feature_layers == FUSED and fused_engine.pair.target.feature_layers == FUSED
    want = fused_engine.run(PROMPT, GenerationConfig(method="ar", max_new_tokens=200)).token_ids
    r = fused_engine.run(PROMPT, GenerationConfig(method=method, max_new_tokens=200, **extra))
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


@pytest.mark.parametrize("fused", [False, True])
def test_distill_head_tiny_end_to_end(tmp_path, fused):
    """distill --kind head trains a head that learns to agree, saves it, and it loads and drafts losslessly; fused:
    over the target's hidden states 1, 2 and 3, held out on the rows of a file (none of which it trains on)."""
    target = make_tiny_model(tmp_path / "target", seed=5, layers=3, init=0.3, context=128)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(
        "".join(json.dumps({"prompt_ids": [2 + i, 3, 4], "response_ids": [5, 6 + i, 7, 2, 3]}) + "\n" for i in range(4))
    )
    extra = ["--feature-layers", "1,2,3", "--held-out", str(held_out), "--eval-every", "5"] if fused else []
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
            *extra,
        ]
    )
    assert code == 0
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    val = [r["val_agreement_by_depth"] for r in log if "val_agreement_by_depth" in r]
    assert len(val[-1]) == 2 and val[-1][0] > val[0][0] + 0.1  # it learns to agree with the target
    card = json.loads((out / "config.json").read_text())["specbranch_head"]
    assert card["kind"] == "head" and card["unroll"] == 2 and card["target_layers"] == 3
    assert card["feature_layers"] == ([1, 2, 3] if fused else None)
    assert (card["held_out_rows"], card["train_rows"]) == (4, 40) if fused else card["train_rows"] < 40
    if fused:  # every 5 steps and at each epoch's end (5 steps an epoch here)
        assert len(val) == 1 + 8
    engine = Engine(load_pair(str(target), str(out), device="cpu"))
    assert isinstance(engine.pair.draft, HeadLM) and engine.pair.target.feature_layers == ((1, 2, 3) if fused else None)
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


def sampled_rows(lm, n=24, seed=0) -> list[dict]:
    """(prompt, response) rows of the tiny target's own sampled text, of differing lengths."""
    torch.manual_seed(seed)
    rows = []
    with torch.inference_mode():
        for i in range(n):
            prompt = torch.randint(2, 10, (1, 2 + i % 3))
            out = lm.model.generate(prompt, do_sample=True, max_new_tokens=6 + i % 5, min_new_tokens=6 + i % 5)
            rows.append({"prompt_ids": prompt[0].tolist(), "response_ids": out[0, prompt.shape[1] :].tolist()})
    return rows


def test_feature_store_holds_each_rows_layers_and_resumes(tiny_target, tmp_path, monkeypatch):
    """Each row reads back as transformers' hidden states FUSED and the final-norm state, side by side (float16),
    computed in padded batches and chunks; a second extraction finds every chunk on disk and runs no forward. Where
    the CPU runs bfloat16 natively the extraction's matmuls are bfloat16 (head_distill.autocast), so the reference,
    one row alone, runs under the same autocast: bfloat16 against float32 moves layer outputs by up to ~0.1 here."""
    _, lm = tiny_target
    rows = sampled_rows(lm)
    monkeypatch.setattr("engine.training.head_distill.CHUNK_ROWS", 10)  # 3 chunks, the last one short
    store = extract_features(lm.model, rows, FeatureStore(tmp_path, rows, FUSED, 32), batch_size=4)
    assert len(store.paths) == 3 and not store.missing()
    for i, r in enumerate(rows):
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_supported()):
            want = torch.cat([side_by_side(lm.model, ids, FUSED), side_by_side(lm.model, ids, (2,))], -1)[0].float()
        assert store[i].dtype == torch.float16 and store[i].shape == want.shape
        assert torch.allclose(store[i].float(), want, atol=2e-2, rtol=1e-2), i
    calls = []
    lm.model.model.register_forward_hook(lambda *a: calls.append(1))
    again = extract_features(lm.model, rows, FeatureStore(tmp_path, rows, FUSED, 32), batch_size=4)
    assert not calls and torch.equal(again[5], store[5])
    assert FeatureStore(tmp_path, rows[:-1], FUSED, 32).missing() == [2]  # its first two chunks are these


def test_head_training_resumes_where_it_stopped(tiny_target, tmp_path):
    """A run stopped at a step and rerun from its checkpoint ends with exactly the weights of a run that never
    stopped (same batches, optimiser state and schedule), fused or not."""
    _, lm = tiny_target
    rows = sampled_rows(lm, seed=1)
    store = extract_features(lm.model, rows, FeatureStore(tmp_path, rows, FUSED, 32))
    train, val = Rows(store, list(range(20))), Rows(store, list(range(20, 24)))
    settings = HeadSettings(vocab=16, unroll=2, epochs=3, lr=3e-3, batch_size=4, feature_layers=FUSED, warmup=3)
    args = (lm.model, rows[:20], train, rows[20:], val)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    straight, _, summary = train_head(*args, settings, tmp_path / "a")
    assert summary["steps"] == 15
    _, _, half = train_head(*args, HeadSettings(**{**settings.__dict__, "stop_at": 7}), tmp_path / "b")
    assert half["steps"] == 7
    resumed, _, summary = train_head(*args, settings, tmp_path / "b")
    assert summary["steps"] == 15
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    log = [json.loads(x) for x in (tmp_path / "b" / "train_head_log.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 0 and [r["step"] for r in log if "val_agreement_by_depth" in r][-1] == 15
