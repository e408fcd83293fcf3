"""`python -m engine distill` end to end on a tiny random target, in seconds: it generates the
target's responses, labels them with the target's top-k distribution, trains a draft whose loss
falls, and writes weights that load as a draft (reduced head included)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.cli import main
from engine.config import GenerationConfig
from engine.drafts.distilled import draft_from_target, load_draft_dir
from engine.engine import Engine
from engine.models.loading import load_pair
from engine.training.distill import initial_draft

from .conftest import make_tiny_model


def test_distill_tiny_end_to_end(tmp_path):
    target = make_tiny_model(tmp_path / "target", seed=5, layers=3, init=0.3, context=128)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": " ".join("abcdefgh"[(i * j) % 8] for j in range(1, 6)), "chat": False}) + "\n"
            for i in range(40)
        )
    )
    out = tmp_path / "draft"
    code = main(
        [
            "distill",
            "--target",
            str(target),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--gen-batch-size",
            "8",
            "--gen-temperature",
            "1.0",
            "--layers",
            "1",
            "--vocab",
            "8",
            "--epochs",
            "6",
            "--lr",
            "3e-3",
            "--batch-size",
            "8",
            "--top-k",
            "4",
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
    # --max-tokens trains on fewer rows and keeps the same held-out rows (a data-size curve)
    labels = sorted((tmp_path / "work").glob("labels_*.pt"))
    assert len(labels) == 1
    stamp = labels[0].stat().st_mtime_ns
    code = main(
        [
            "distill",
            "--target",
            str(target),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--max-tokens",
            "100",
            "--layers",
            "1",
            "--vocab",
            "8",
            "--epochs",
            "1",
            "--top-k",
            "4",
            "--val-fraction",
            "0.1",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "small"),
            "--device",
            "cpu",
        ]
    )
    small = json.loads((tmp_path / "small" / "config.json").read_text())["specbranch_draft"]
    assert code == 0 and small["held_out_rows"] == card["held_out_rows"]
    assert 100 <= small["train_response_tokens"] < 100 + 25 < card["train_response_tokens"]
    assert labels[0].stat().st_mtime_ns == stamp  # labels reused, not recomputed
    # --init goes on training the saved draft: it starts from its weights, not from the target's layers
    start = initial_draft(engine.pair.target.model, 1, out).state_dict()
    fresh = draft_from_target(engine.pair.target.model, 1).state_dict()
    saved = load_draft_dir(out, engine.pair.target.model, torch.float32, torch.device("cpu"))[0].state_dict()
    layer = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(start[layer], saved[layer]) and not torch.allclose(start[layer], fresh[layer])
    code = main(
        [
            "distill",
            "--target",
            str(target),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--init",
            str(out),
            "--vocab",
            "8",
            "--epochs",
            "1",
            "--lr",
            "1e-3",
            "--batch-size",
            "8",
            "--top-k",
            "4",
            "--val-fraction",
            "0.1",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "more"),
            "--device",
            "cpu",
        ]
    )
    more = json.loads((tmp_path / "more" / "config.json").read_text())["specbranch_draft"]
    first = json.loads((tmp_path / "more" / "training_log.jsonl").read_text().splitlines()[0])
    assert code == 0 and more["init"] == str(out) and more["layers"] == 1
    assert abs(first["val_agreement"] - card["val_agreement"]) <= 0.03  # where the first run ended


TINY_CHAT = "{% for m in messages %}a {{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}b {% endif %}"


def test_self_prompts_magpie_tiny(tmp_path, capsys):
    """--self-prompts: the target writes user questions from the template's pre-query prefix alone;
    only finished, new, non-excluded questions are kept; the file resumes; the responses follow."""
    from transformers import AutoTokenizer

    from engine.training.common import read_jsonl
    from engine.training.distill import generate_self_prompts, pre_query_ids, shingles

    target = make_tiny_model(tmp_path / "target", seed=3, layers=2, init=0.3, context=128, eos=1)
    tok = AutoTokenizer.from_pretrained(target)
    # without a chat template there is nothing to prompt from: a clear error, exit 2
    code = main(
        [
            "distill",
            "--target",
            str(target),
            "--self-prompts",
            "4",
            "--generate-only",
            "--work-dir",
            str(tmp_path / "w0"),
            "--out",
            str(tmp_path / "d0"),
            "--device",
            "cpu",
        ]
    )
    assert code == 2 and "chat template" in capsys.readouterr().err
    tok.chat_template = TINY_CHAT
    tok.save_pretrained(target)
    assert pre_query_ids(tok) == ([2], 1)  # "a " opens a user turn, <eos> ends it

    model = load_pair(str(target), None, device="cpu").target.model
    out = tmp_path / "self.jsonl"
    generate_self_prompts(model, tok, 10, out, batch_size=8, seed=0, exclude=set())
    first = read_jsonl(out)
    assert len(first) == 10 and len({r["prompt"] for r in first}) == 10
    assert all(len(r["prompt"]) >= 12 and "<eos>" not in r["prompt"] and r["chat"] for r in first)
    generate_self_prompts(model, tok, 16, out, batch_size=8, seed=0, exclude=set())
    rows = read_jsonl(out)
    assert rows[:10] == first and len(rows) == 16 and len({r["prompt"] for r in rows}) == 16
    # same seed, fresh file, with the first questions' 8-word runs excluded: the long ones come back no more
    banned = set().union(*(shingles(r["prompt"]) for r in first))
    long_ones = {r["prompt"] for r in first if shingles(r["prompt"])}
    assert long_ones
    again = tmp_path / "again.jsonl"
    generate_self_prompts(model, tok, 10, again, batch_size=8, seed=0, exclude=banned)
    kept = {r["prompt"] for r in read_jsonl(again)}
    assert len(kept) == 10 and not kept & long_ones
    # through the CLI: questions, then the target's answers to them
    code = main(
        [
            "distill",
            "--target",
            str(target),
            "--self-prompts",
            "12",
            "--generate-only",
            "--gen-batch-size",
            "8",
            "--max-new-tokens",
            "16",
            "--work-dir",
            str(tmp_path / "w1"),
            "--out",
            str(tmp_path / "d1"),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    answered = read_jsonl(tmp_path / "w1" / "self_generated.jsonl")
    questions = read_jsonl(tmp_path / "w1" / "self_prompts.jsonl")
    assert len(answered) == len(questions) == 12
    assert all(a["prompt_ids"][:1] == [2] and a["prompt_ids"][-1] == 3 for a in answered)  # "a ... <eos> b"
    assert all(0 < len(a["response_ids"]) <= 16 for a in answered)


def test_self_prompts_open_with_the_leads_in_turn(tmp_path, capsys):
    """--self-prompt-leads: row j of a round opens with lead j mod len(leads), a phrase of two tokens as well as a
    word, each row left-padded to one width; without leads the same target opens its questions otherwise."""
    from transformers import AutoTokenizer

    from engine.training.common import read_jsonl
    from engine.training.distill import generate_self_prompts

    target = make_tiny_model(tmp_path / "target", seed=3, layers=2, init=0.3, context=128, eos=1)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = TINY_CHAT
    tok.save_pretrained(target)
    model = load_pair(str(target), None, device="cpu").target.model
    plain, led = tmp_path / "plain.jsonl", tmp_path / "led.jsonl"
    generate_self_prompts(model, tok, 12, plain, batch_size=8, seed=0, exclude=set())
    generate_self_prompts(model, tok, 12, led, batch_size=8, seed=0, exclude=set(), leads=("c d", "e"))
    opened = [r["prompt"] for r in read_jsonl(led)]
    assert len(opened) == 12 and all(q.startswith(("c d ", "e ")) for q in opened)
    assert {q.startswith("c d ") for q in opened} == {True, False}  # both leads, not one for every row
    unled = [r["prompt"] for r in read_jsonl(plain)]
    assert not all(q.startswith(("c d ", "e ")) for q in unled)  # the leads, not the model, open them
    # through the CLI; a list with an empty word is refused before the target loads
    args = ["distill", "--target", str(target), "--self-prompts", "6", "--generate-only", "--gen-batch-size", "4"]
    args += ["--max-new-tokens", "8", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "d")]
    with pytest.raises(SystemExit) as bad:
        main([*args, "--self-prompt-leads", "c d,,e"])
    assert bad.value.code == 2 and "non-empty" in capsys.readouterr().err
    leads_alone = ["distill", "--target", str(target), "--corpus", str(led), "--self-prompt-leads", "e"]
    assert main([*leads_alone, "--out", str(tmp_path / "d")]) == 2
    assert "--self-prompts N" in capsys.readouterr().err
    assert main([*args, "--self-prompt-leads", "c d,e", "--device", "cpu"]) == 0
    questions = [r["prompt"] for r in read_jsonl(tmp_path / "w" / "self_prompts.jsonl")]
    assert len(questions) == 6 and all(q.startswith(("c d ", "e ")) for q in questions)
    assert len(read_jsonl(tmp_path / "w" / "self_generated.jsonl")) == 6


def test_distill_bad_input(tmp_path, capsys):
    """An empty or missing prompt file and an output path that cannot be written are refused at once,
    with the reason, before any model is loaded (exit 2)."""
    target = make_tiny_model(tmp_path / "target", seed=5, layers=1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a b c", "chat": false}\n')
    base = ["distill", "--target", str(target), "--work-dir", str(tmp_path / "work"), "--device", "cpu"]
    cases = [
        (["--prompts", str(empty), "--out", str(tmp_path / "d")], "holds no rows"),
        (["--prompts", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "d")], "file not found"),
        (["--corpus", str(empty), "--out", str(tmp_path / "d")], "holds no rows"),
        (["--out", str(tmp_path / "d")], "needs training data"),
        (["--prompts", str(target / "config.json"), "--out", str(tmp_path / "d")], "not valid JSON"),
        (["--prompts", str(prompts), "--out", str(blocker / "draft")], "cannot write the draft"),
        (["--prompts", str(prompts), "--init", str(tmp_path), "--out", str(tmp_path / "d")], "not a draft directory"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # nothing written for refused input


def test_the_shipped_training_corpora_read_gzipped():
    """The training corpora ship gzipped (data/*.jsonl.gz); read_jsonl reads them as the plain files they were,
    and a plain file still reads."""
    from engine.measure.datasets import DATA_DIR
    from engine.training.common import read_jsonl

    rows = read_jsonl(DATA_DIR / "teacher_smollm2_135m.jsonl.gz")
    assert len(rows) == 2360 and {"prompt_ids", "response_ids"} <= set(rows[0])
    plain = DATA_DIR / "tuning_prompts.jsonl"
    assert read_jsonl(plain) == [json.loads(line) for line in plain.read_text().splitlines() if line]


def test_grown_draft_starts_as_the_draft_it_grew_from(tmp_path):
    """--grow: the new layers add nothing until trained (the same logits, to float rounding), yet they are the
    target's layers at that depth apart from their zeroed output projections, so their gradients flow at once."""
    from engine.drafts.distilled import grown
    from engine.models.loading import load_model

    model, _ = load_model(str(make_tiny_model(tmp_path / "t", seed=3, layers=4)), torch.device("cpu"), torch.float32)
    draft = draft_from_target(model, 2)
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(0.1 * torch.randn_like(p))  # a trained draft: no longer the target's layers
    bigger = grown(draft, model, 1)
    ids = torch.tensor([[2, 5, 3, 7, 4, 4, 8]])
    with torch.no_grad():
        assert torch.allclose(bigger(ids).logits, draft(ids).logits, atol=1e-5)
    assert bigger.config.num_hidden_layers == 3
    assert torch.equal(bigger.model.layers[1].mlp.up_proj.weight, draft.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(bigger.model.layers[2].mlp.up_proj.weight, model.model.layers[2].mlp.up_proj.weight)
    bigger(ids).logits.sum().backward()
    assert bigger.model.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0


def test_distill_hard_labels_need_no_target_pass_over_training_rows(tmp_path):
    """--hard-labels trains a standalone draft on the answers' own tokens: only the held-out rows (from --held-out)
    are labelled by the target, and the draft still learns to agree with the target's argmax there."""
    from engine.training.distill import hard_labels

    rows = [{"prompt_ids": [2, 3], "response_ids": [4, 5, 6]}]
    (label,) = hard_labels(rows)
    assert label["ids"].tolist() == [[4], [5], [6]] and label["probs"].tolist() == [[1.0]] * 3
    target = make_tiny_model(tmp_path / "target", seed=5, layers=3, init=0.3, context=128)
    corpus, held_out = tmp_path / "corpus.jsonl", tmp_path / "held_out.jsonl"
    model = load_pair(str(target), None, device="cpu").target.model
    torch.manual_seed(0)
    with torch.inference_mode():
        prompts = torch.randint(2, 10, (48, 4))
        out = model.generate(prompts, do_sample=False, max_new_tokens=20, min_new_tokens=20)
    lines = [
        json.dumps({"prompt_ids": p.tolist(), "response_ids": o[4:].tolist()}) + "\n" for p, o in zip(prompts, out)
    ]
    corpus.write_text("".join(lines))
    held_out.write_text("".join(lines[:6]))  # their prompts are dropped from training
    argv = ["distill", "--target", str(target), "--corpus", str(corpus), "--held-out", str(held_out), "--hard-labels"]
    argv += ["--layers", "1", "--vocab", "10", "--epochs", "6", "--lr", "3e-3", "--batch-size", "8", "--top-k", "4"]
    code = main([*argv, "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "d"), "--device", "cpu"])
    assert code == 0
    card = json.loads((tmp_path / "d" / "config.json").read_text())["specbranch_draft"]
    assert card["hard_labels"] and card["held_out_rows"] == 6 and card["train_rows"] == 48 - 6
    assert [p.name for p in (tmp_path / "work").glob("labels_*.pt")] == ["labels_top4_val_6_0.pt"]
    log = [json.loads(x) for x in (tmp_path / "d" / "training_log.jsonl").read_text().splitlines()]
    val = [r["val_agreement"] for r in log if "val_agreement" in r]
    assert val[-1] > val[0] + 0.1  # from 0.55 (the target's first layer) to 0.68 when written


def test_draft_training_resumes_where_it_stopped(tmp_path):
    """A standalone run stopped at a step and rerun from its checkpoint ends with exactly the weights of a run that
    never stopped (the same batches, optimiser state and schedule)."""
    from engine.models.loading import load_model
    from engine.training.distill import DraftSettings, hard_labels, train_draft

    model, _ = load_model(str(make_tiny_model(tmp_path / "t", seed=3, layers=3)), torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    with torch.inference_mode():
        out = model.generate(torch.randint(2, 10, (24, 3)), do_sample=True, max_new_tokens=8, min_new_tokens=8)
    rows = [{"prompt_ids": o[:3].tolist(), "response_ids": o[3:].tolist()} for o in out]
    settings = DraftSettings(layers=1, vocab=12, epochs=3, lr=3e-3, batch_size=4, checkpoint_every=2)
    args = (model, rows[:20], hard_labels(rows[:20]), rows[20:], hard_labels(rows[20:]))
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    straight, _, summary = train_draft(*args, settings, tmp_path / "a")
    assert summary["steps"] == 15
    assert train_draft(*args, DraftSettings(**{**settings.__dict__, "stop_at": 7}), tmp_path / "b")[2]["steps"] == 7
    resumed, _, summary = train_draft(*args, settings, tmp_path / "b")
    assert summary["steps"] == 15
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
