"""Which cheap draft learns to agree with the embedded target fastest: a like-for-like comparison (docs/models.md).

The candidates train on the same rows (a subset of the training split), with the same labels (the target's
distribution over the same reduced vocabulary, computed from its final-norm features), the same batches and the same
learning-rate schedule, each for the same budget of its own process's CPU time (fair on a shared machine), and are
scored on the same held-out rows (the 258 rows `distill` holds out of the three shipped corpora):
  head-fused   a 1-layer head reading the target's hidden states 2, 15 and 27 (low, mid, high; EAGLE-3)
  head-last    the same head reading the target's final-norm state (the shipped embedded-head's design)
  standalone6  the target's first 6 layers as a small LM (the shipped embedded draft's design, from its start)
  standalone6-shipped  the shipped 6-layer draft trained on (on rows it has seen, unless --rows: a control)
  standalone8-grown    the shipped draft with 2 more layers that start as no-ops (drafts.distilled.grown)

Stages (each resumable; the target's features are stored once, memory-mapped, under --work):
  python docs/results/tools/compare_drafts.py features --work DIR [--tokens 150000] [--rows FILE.jsonl]
  python docs/results/tools/compare_drafts.py train CANDIDATE --work DIR --cpu-minutes 20
Each train run logs JSON lines (CPU minutes, tokens seen, held-out agreement by depth) to DIR/CANDIDATE.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.drafts.distilled import draft_from_target, grown, load_draft_dir  # noqa: E402
from engine.drafts.shipped import DRAFTS_DIR, EMBEDDED_DRAFTS  # noqa: E402
from engine.training.common import capped_rows, frequent_vocab, optimizer_step, read_jsonl, split_by_prompt  # noqa: E402
from engine.training.head_distill import (  # noqa: E402
    FeatureStore,
    HeadSettings,
    Rows,
    Trainer,
    autocast,
    evaluate,
    extract_features,
    feature_batches,
    losses,
)

CORPORA = [f"data/{n}_smollm2_135m.jsonl.gz" for n in ("teacher", "self", "self2")]
LAYERS = (2, 15, 27)


class FinalOnly:
    """The stored rows [n, 4H] seen as their final-norm state [n, H] (what a last-state head and a standalone read)."""

    def __init__(self, feats, hidden: int):
        self.feats, self.hidden = feats, hidden

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.feats[i][:, -self.hidden :]

    def __len__(self) -> int:
        return len(self.feats)


def load_rows(args) -> tuple[list[dict], list[dict]]:
    """(the comparison's training rows, the held-out rows): as distill splits the shipped corpora (val 0.03, seed 0);
    the training rows are a seeded subset of about --tokens response tokens, or the rows of --rows."""
    rows = []
    for corpus in CORPORA:
        rows += [{"prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"]} for r in read_jsonl(Path(corpus))]
    rows = [r for r in rows if r["response_ids"]]
    train, val = split_by_prompt(rows, 0.03, 0)
    if args.rows:
        train = [
            {"prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"]} for r in read_jsonl(Path(args.rows))
        ]
        train = [r for r in train if r["response_ids"]]
    train = [train[i] for i in capped_rows(train, args.tokens, 0)]
    return train[: args.train_rows or None], val[: args.val_rows or None]


def load_target(threads: int):
    from engine.models.loading import load_pair

    torch.set_num_threads(threads)
    target = load_pair("embedded", None, device="cpu", dtype="float32").target.model
    return target.requires_grad_(False)


def stores(args, target):
    train, val = load_rows(args)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    store = FeatureStore(work, train + val, LAYERS, target.config.hidden_size)
    return train, val, store


def cmd_features(args) -> None:
    target = load_target(args.threads)
    train, val, store = stores(args, target)
    print(f"{len(train)} rows, {sum(len(r['response_ids']) for r in train)} response tokens; {len(val)} held out")
    t = time.process_time()
    extract_features(target, train + val, store, 8)
    print(f"features: {(time.process_time() - t) / 60:.1f} CPU minutes")


class StandaloneTrainer:
    """A standalone draft trained on the same labels as the heads: its final-norm state over the reduced head, soft
    cross-entropy against the target's distribution (losses() with one 'unroll step'); the Trainer's surface."""

    def __init__(self, target, rows, s: HeadSettings, init: Path | None, grow: int = 0):
        torch.manual_seed(s.seed)
        self.settings = s
        if init is None:
            self.draft = draft_from_target(target, 6)
        else:
            self.draft, _ = load_draft_dir(init, target, torch.float32, torch.device("cpu"))
            self.draft = grown(self.draft, target, grow) if grow else self.draft
        self.draft.train()
        for module in (self.draft.model.embed_tokens, self.draft.lm_head):
            module.requires_grad_(False)
        self.subset = frequent_vocab(rows, s.vocab, target.get_output_embeddings().weight.shape[0])
        self.sub_head = target.get_output_embeddings().weight[self.subset].detach().float().contiguous()
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=s.lr, weight_decay=0.0)
        self.per_epoch = math.ceil(len(rows) / s.batch_size)
        self.total = total = max(1, int(s.epochs * self.per_epoch))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda k: min(1.0, (k + 1) / s.warmup) * 0.5 * (1 + math.cos(math.pi * min(k, total) / total)),
        )
        self.step, self.cpu0 = 0, time.process_time()

    def cpu_minutes(self) -> float:
        return (time.process_time() - self.cpu0) / 60

    def outs(self, ids):
        return [self.draft.model(input_ids=ids).last_hidden_state]

    def train_step(self, ids, raw, f, m):
        with autocast(ids.device):
            loss, agree = losses(self.outs(ids), f, m, self.sub_head, 0.0)
        optimizer_step(loss, self.params, self.opt, self.sched)
        self.step += 1
        return loss.item(), agree

    def evaluate(self, rows, feats, batch_size: int) -> list[float]:
        self.draft.eval()
        a = n = 0
        with torch.inference_mode():
            for ids, _, f, m in feature_batches(rows, feats, batch_size, False, 0, "cpu", f_width(feats)):
                (x, y), *_ = losses(self.outs(ids), f, m, self.sub_head, 0.0)[1]
                a, n = a + x, n + y
        self.draft.train()
        return [round(a / max(n, 1), 4)]


def f_width(feats) -> int:
    return feats[0].shape[-1]


def cmd_train(args) -> None:
    target = load_target(1)
    train, val, store = stores(args, target)
    if store.missing():
        raise SystemExit("run the features stage first")
    h = target.config.hidden_size
    fused = args.candidate == "head-fused"
    feats = Rows(store, list(range(len(train))))
    val_feats = Rows(store, list(range(len(train), len(train) + len(val))))
    if not fused:
        feats, val_feats = FinalOnly(feats, h), FinalOnly(val_feats, h)
    s = HeadSettings(
        layers=1,
        unroll=3,
        epochs=args.epochs,
        lr=args.lr,
        batch_size=8,
        feature_layers=LAYERS if fused else None,
        checkpoint_every=0,
        warmup=20,
    )
    if args.candidate.startswith("head"):
        t = Trainer(target, train, s, Path(args.work))
        embed = t.embed

        def held_out():
            return evaluate(t.head, val, val_feats, embed, t.sub_head, 3, 8)
    else:
        shipped = args.candidate in ("standalone6-shipped", "standalone8-grown")
        init = DRAFTS_DIR / EMBEDDED_DRAFTS["embedded"] if shipped else None
        t = StandaloneTrainer(target, train, s, init, 2 if args.candidate == "standalone8-grown" else 0)

        def held_out():
            return t.evaluate(val, val_feats, 8)

    run(args, t, train, feats, held_out, s, h)


def run(args, t, train, feats, held_out, s: HeadSettings, hidden: int) -> None:
    """Train until the CPU budget or the epochs run out, scoring the held-out rows every --eval-minutes of CPU."""
    log = open(Path(args.work) / f"{args.name or args.candidate}.jsonl", "w")
    tokens_per_step = sum(len(r["response_ids"]) for r in train) / t.per_epoch
    eval_cpu = 0.0  # CPU time spent scoring, not counted against the budget

    def score(final: bool = False):
        nonlocal eval_cpu
        c = time.process_time()
        val = held_out()
        eval_cpu += time.process_time() - c
        line = dict(step=t.step, tokens=round(t.step * tokens_per_step), cpu_minutes=round(train_minutes(), 2))
        print(json.dumps({**line, "val_agreement_by_depth": val, "final": final}), file=log, flush=True)

    def train_minutes():
        return t.cpu_minutes() - eval_cpu / 60

    score()
    next_eval = args.eval_minutes
    for epoch in range(math.ceil(s.epochs)):
        for ids, raw, f, m in feature_batches(train, feats, s.batch_size, True, s.seed + epoch, "cpu", hidden):
            loss, agree = t.train_step(ids, raw, f, m)
            if t.step % 25 == 0:
                d = [round(x / max(y, 1), 3) for x, y in agree]
                print(
                    json.dumps(dict(step=t.step, loss=round(loss, 4), train_agreement_by_depth=d)), file=log, flush=True
                )
            if train_minutes() >= next_eval:
                score()
                next_eval += args.eval_minutes
            if t.step >= t.total or train_minutes() >= args.cpu_minutes:
                break
        if t.step >= t.total or train_minutes() >= args.cpu_minutes:
            break
    score(final=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("features", "train"):
        q = sub.add_parser(name)
        q.add_argument("--work", required=True)
        q.add_argument("--tokens", type=int, default=150_000, help="response tokens of training rows")
        q.add_argument("--rows", help="train on these rows (JSONL) instead of a subset of the shipped corpora")
        q.add_argument("--threads", type=int, default=1)
        q.add_argument("--train-rows", type=int, default=0, help="only the first N of those rows (0: all)")
        q.add_argument("--val-rows", type=int, default=0, help="only the first N held-out rows (0: all 258)")
        if name == "train":
            q.add_argument(
                "candidate",
                choices=("head-fused", "head-last", "standalone6", "standalone6-shipped", "standalone8-grown"),
            )
            q.add_argument("--cpu-minutes", type=float, default=20)
            q.add_argument("--eval-minutes", type=float, default=5)
            q.add_argument("--epochs", type=float, default=1)
            q.add_argument("--lr", type=float, default=1e-3)
            q.add_argument("--name", help="the log's name (default: the candidate's)")
    args = p.parse_args()
    (cmd_features if args.cmd == "features" else cmd_train)(args)


if __name__ == "__main__":
    main()
