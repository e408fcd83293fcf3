"""`python -m engine distill` end to end on a tiny random target, in seconds: it generates the
target's responses, labels them with the target's top-k distribution, trains a draft whose loss
falls, and writes weights that load as a draft (reduced head included)."""
from __future__ import annotations

import json

from engine.__main__ import main
from engine.config import GenerationConfig
from engine.engine import Engine
from engine.models import load_pair

from .conftest import make_tiny_model


def test_distill_tiny_end_to_end(tmp_path):
    target = make_tiny_model(tmp_path / "target", seed=5, layers=3, init=0.3, context=128)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join("abcdefgh"[(i * j) % 8] for j in range(1, 6)),
                                           "chat": False}) + "\n" for i in range(40)))
    out = tmp_path / "draft"
    code = main(["distill", "--target", str(target), "--prompts", str(prompts), "--max-new-tokens", "24",
                 "--gen-batch-size", "8", "--gen-temperature", "1.0", "--layers", "1", "--vocab", "8",
                 "--epochs", "6", "--lr", "3e-3", "--batch-size", "8", "--top-k", "4", "--val-fraction", "0.1",
                 "--work-dir", str(tmp_path / "work"), "--out", str(out), "--device", "cpu"])
    assert code == 0
    log = [json.loads(line) for line in (out / "training_log.jsonl").read_text().splitlines()]
    losses = [r["epoch_loss"] for r in log if "epoch_loss" in r]  # mean KL loss of each epoch
    assert len(losses) == 6 and losses[-1] < 0.9 * losses[0]
    card = json.loads((out / "config.json").read_text())["specbranch_draft"]
    assert card["layers"] == 1 and card["vocab_subset_size"] == 8
    # the saved draft loads against its target and speculates losslessly
    engine = Engine(load_pair(str(target), str(out), device="cpu"))
    ids = [2, 3, 4]
    want = engine.run(ids, GenerationConfig(method="ar", max_new_tokens=30)).token_ids
    r = engine.run(ids, GenerationConfig(method="sd", max_new_tokens=30, gamma=3))
    assert r.token_ids == want and r.metrics["drafted_tokens"] > 0
    assert engine.pair.draft.head_ids is not None and len(engine.pair.draft.head_ids) == 8
    # resumable: a second run reuses the generated responses and the labels
    generated = (tmp_path / "work" / "generated.jsonl").read_text()
    assert len(generated.splitlines()) == 40
    engine.close()
