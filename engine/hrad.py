"""H-RAD: a small classifier that reads the target's hidden state and the draft's confidence, and
predicts how the next drafted block will fare, so that SpecBranch knows where to branch.

Inputs (SPECBRANCH.md §3): the target's hidden states from its last 4 layers at the last verified
position, concatenated with the embedding of the next token (the correction just committed): 5·H
numbers. A fixed projection fitted on the training samples (PCA, whitened) shrinks them to d, because
a few thousand samples of 2,880 raw features are memorised, not learned. The draft's confidence in the
first token it drafts after the verdict is appended: the classifier runs at that draft step.
Classes, from the run of draft tokens accepted after that position before the next rejection:
  0  rejected at once (run = 0)        -> branch at the very first draft token
  1  partly accepted (0 < run < L)     -> draft while confident, branch at the first token below ε
  2  all accepted   (run >= L)         -> draft linearly, no branch this round
L is the label horizon (default 4).
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import SpecBranchError

N_LAYERS = 4
CLASSES = ("reject at once", "partly accepted", "all accepted")


class HRAD(torch.nn.Module):
    """features [5H] -> (x - mean) @ projection [d] ; confidence [1] -> MLP -> 3 logits."""

    def __init__(self, in_dim: int, proj_dim: int = 32, hidden: int = 64, dropout: float = 0.0):
        super().__init__()
        self.in_dim, self.proj_dim, self.dropout = in_dim, proj_dim, dropout
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("projection", torch.zeros(in_dim, proj_dim))  # whitened PCA, fitted, never trained
        self.fc1 = torch.nn.Linear(proj_dim + 1, hidden)
        self.fc2 = torch.nn.Linear(hidden, 3)

    def fit_projection(self, x: torch.Tensor) -> None:
        """PCA on the training features [N, in_dim]; each kept direction scaled to unit variance."""
        self.mean.copy_(x.mean(0))
        _, s, v = torch.linalg.svd(x - self.mean, full_matrices=False)
        std = (s[: self.proj_dim] / max(1, len(x) - 1) ** 0.5).clamp_min(1e-6)
        self.projection.copy_(v[: self.proj_dim].T / std)

    def forward(self, x: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        z = torch.cat([(x - self.mean) @ self.projection, confidence[:, None]], dim=-1)  # [B, d + 1]
        h = torch.nn.functional.dropout(torch.nn.functional.gelu(self.fc1(z)), self.dropout, self.training)
        return self.fc2(h)

    @torch.inference_mode()
    def predict(self, features: torch.Tensor, confidence: float) -> int:
        return int(self(features.float()[None], torch.tensor([confidence])).argmax(-1))


def features(hidden_states: tuple, position: int, next_embedding: torch.Tensor) -> torch.Tensor:
    """[4 * H + H] feature vector on CPU: last-4-layer states at `position` (batch row 0) + next-token embedding."""
    parts = [h[0, position].float().cpu() for h in hidden_states[-N_LAYERS:]]
    return torch.cat(parts + [next_embedding.float().cpu()])


def label(run: int, horizon: int) -> int:
    return 0 if run == 0 else (2 if run >= horizon else 1)


@dataclass
class Sample:
    prompt: int  # which prompt it came from: validation splits by prompt, never by sample
    features: torch.Tensor  # [5H]
    confidence: float  # the draft's confidence in the first token it drafted after the verdict
    label: int


def pair_signature(pair) -> dict:
    """What an H-RAD classifier depends on: the target's features and the draft's confidence."""
    def sig(lm):
        c = lm.model.config
        return {"hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
                "vocab_rows": len(lm.head_ids) if lm.head_ids is not None else lm.vocab_size}
    return {"target": sig(pair.target), "draft": sig(pair.draft)}


def save_hrad(model: HRAD, path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps(
        {"in_dim": model.in_dim, "proj_dim": model.proj_dim, "hidden": model.fc1.out_features, **meta}, indent=2))


def load_hrad(path: Path, signature: dict) -> HRAD:
    """Load H-RAD weights; raises SpecBranchError if missing, of the old format, or made for another pair."""
    meta_path = path.with_suffix(".json")
    if not path.exists() or not meta_path.exists():
        raise SpecBranchError(f"no H-RAD weights at {path}")
    meta = json.loads(meta_path.read_text())
    for model in ("target", "draft"):
        made_for = meta.get("pair", {}).get(model)
        if made_for != signature[model]:
            diff = ", ".join(f"{k} {(made_for or {}).get(k, '?')} (this {model}: {v})"
                             for k, v in signature[model].items() if (made_for or {}).get(k) != v)
            raise SpecBranchError(f"H-RAD weights at {path} were trained for another {model}: {diff}; "
                                  f"retrain them with `python -m engine train-hrad`")
    model = HRAD(meta["in_dim"], meta["proj_dim"], meta["hidden"])
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def macro_f1(pred: torch.Tensor, gold: torch.Tensor) -> float:
    """Mean over the 3 classes of F1 (a class absent from both counts as 0)."""
    scores = []
    for c in range(3):
        tp = int(((pred == c) & (gold == c)).sum())
        denom = int((pred == c).sum()) + int((gold == c).sum())
        scores.append(2 * tp / denom if denom else 0.0)
    return sum(scores) / 3


def confidence_rule(confidence: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """The confidence-only classifier: below `low` reject at once, from `high` all accepted, else partly."""
    return torch.where(confidence < low, 0, torch.where(confidence >= high, 2, 1))


def fit_confidence_rule(confidence: torch.Tensor, gold: torch.Tensor) -> tuple[float, float]:
    """The thresholds (low, high) with the best macro-F1 on the training samples, on a 0.05 grid."""
    grid = [i / 20 for i in range(21)]
    return max(((lo, hi) for lo in grid for hi in grid if hi >= lo),
               key=lambda t: macro_f1(confidence_rule(confidence, *t), gold))


def scores(pred: torch.Tensor, gold: torch.Tensor) -> dict:
    return {"accuracy": round(float((pred == gold).float().mean()), 4) if len(gold) else None,
            "macro_f1": round(macro_f1(pred, gold), 4) if len(gold) else None}


def split_by_prompt(samples: list[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """Hold out whole prompts, so that validation never sees a neighbour of a training sample."""
    prompts = sorted({s.prompt for s in samples})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: max(1, round(len(prompts) * fraction))]) if len(prompts) > 1 else set()
    return [s for s in samples if s.prompt not in held], [s for s in samples if s.prompt in held]


def tensors(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.stack([s.features for s in samples]).float(), torch.tensor([s.confidence for s in samples]),
            torch.tensor([s.label for s in samples]))


def train_classifier(train: list[Sample], epochs: int = 30, batch_size: int = 32, lr: float = 1e-3, seed: int = 0,
                     proj_dim: int = 8, hidden: int = 64, dropout: float = 0.2,
                     weight_decay: float = 0.01) -> HRAD:
    """Fit the projection, then train the MLP with a class-balanced loss (each class weighs the same)."""
    torch.manual_seed(seed)
    x, conf, y = tensors(train)
    counts = torch.bincount(y, minlength=3).float()
    model = HRAD(x.shape[1], min(proj_dim, len(train)), hidden, dropout)
    model.fit_projection(x)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    weights = counts.sum() / (3 * counts.clamp_min(1))
    order = list(range(len(train)))
    model.train()
    for epoch in range(epochs):
        random.Random(seed + epoch).shuffle(order)
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            loss = torch.nn.functional.cross_entropy(model(x[idx], conf[idx]), y[idx], weight=weights)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def evaluate(model: HRAD, train: list[Sample], sets: dict[str, list[Sample]]) -> dict:
    """H-RAD against the majority class and the confidence-only rule (thresholds fitted on `train`)."""
    _, conf_train, y_train = tensors(train)
    majority = int(torch.bincount(y_train, minlength=3).argmax())
    low, high = fit_confidence_rule(conf_train, y_train)
    report = {"class_counts_train": torch.bincount(y_train, minlength=3).tolist(),
              "confidence_rule": {"low": low, "high": high}}
    for name, rows in {"train": train, **sets}.items():
        if not rows:
            report[name] = None
            continue
        x, conf, y = tensors(rows)
        with torch.inference_mode():
            pred = model(x, conf).argmax(-1)
        report[name] = {"samples": len(rows), "class_counts": torch.bincount(y, minlength=3).tolist(),
                        "hrad": scores(pred, y), "majority": scores(torch.full_like(y, majority), y),
                        "confidence_only": scores(confidence_rule(conf, low, high), y)}
    return report


def hrad_path_for(draft_name: str) -> Path | None:
    """Where a draft's H-RAD weights live: beside the draft's own weights."""
    from .models import DRAFTS_DIR, EMBEDDED_DRAFTS

    if draft_name in EMBEDDED_DRAFTS:
        return DRAFTS_DIR / EMBEDDED_DRAFTS[draft_name] / "hrad.safetensors"
    path = Path(draft_name).expanduser()
    return path / "hrad.safetensors" if path.is_dir() else None


def find_hrad(pair) -> tuple[HRAD | None, str]:
    """(classifier, notice): the notice says why there is none."""
    if pair.draft is None:
        return None, "no draft"
    if getattr(pair.draft, "reads_target_features", False):
        return None, "a draft head has no H-RAD classifier"
    path = hrad_path_for(pair.draft.name)
    if path is None:
        return None, f"no H-RAD weights for draft {pair.draft.name!r}"
    try:
        return load_hrad(path, pair_signature(pair)), ""
    except SpecBranchError as exc:
        return None, str(exc)


@torch.inference_mode()
def forced_samples(pair, prompt_ids: list[int], response: list[int], horizon: int, prompt: int = 0) -> list[Sample]:
    """Samples from one greedy response of the target, with no speculative run: one target pass and one
    draft pass over prompt + response give, at every response token r_t that the draft mispredicted (a
    correction, where the engine runs H-RAD at T=0), the target's state at r_{t-1} with emb(r_t), the
    draft's confidence after r_t, and how many of r_{t+1}.. the draft's greedy tokens match in a row:
    drafting on from a correction, the draft sees the true prefix for as long as it keeps matching."""
    target, draft = pair.target, pair.draft
    ids = torch.tensor([prompt_ids + response])
    out = target.forward(ids, target.new_cache(), hidden_states=True)
    d_logits = draft.forward(ids, draft.new_cache())[0, len(prompt_ids) - 1:].float()  # row j predicts response[j]
    guess = d_logits.argmax(-1).tolist()
    confidence = d_logits.softmax(-1).amax(-1).tolist()
    emb = target.model.get_input_embeddings()(ids[0].to(target.device))
    samples = []
    for t in range(1, len(response)):
        if guess[t] == response[t]:
            continue  # the draft predicted r_t: no verdict discards speculation here
        run = 0
        while t + 1 + run < len(response) and guess[t + 1 + run] == response[t + 1 + run]:
            run += 1
        if t + 1 + run >= len(response) and run < horizon:
            continue  # cut short by the end of the response: unknown
        position = len(prompt_ids) + t - 1  # r_{t-1}: the last position the target verified
        samples.append(Sample(prompt, features(out.hidden_states, position, emb[position + 1]),
                              confidence[t + 1], label(run, horizon)))
    return samples


def training_rows(corpora: list[Path], limit: int, seed: int) -> list[dict]:
    """Up to `limit` distinct training-split prompts with the target's greedy response, the same number
    from each source (GSM8K, HumanEval, MT-Bench second turns, the target's own questions), so that the
    classifier does not learn only GSM8K's rhythm."""
    from .distill import read_jsonl

    by_source: dict[str, list[dict]] = {}
    seen = set()
    for r in (row for corpus in corpora for row in read_jsonl(corpus)):
        key = tuple(r.get("prompt_ids", ()))
        if key and r.get("response_ids") and r.get("mode", "greedy") == "greedy" and key not in seen:
            seen.add(key)
            by_source.setdefault(r.get("source", ""), []).append(r)
    rng = random.Random(seed)
    picked = []
    for source in sorted(by_source):
        rng.shuffle(by_source[source])
        picked += by_source[source][: max(1, limit // len(by_source))]
    return picked[:limit]


def samples_key(pair, settings: dict) -> dict:
    """What collected samples depend on: both models' weights (a digest) and the collection settings. Samples
    collected with another draft (same shapes, other weights) must not be reused."""
    digest = hashlib.sha256()
    for lm in (pair.target, pair.draft):
        for name, t in sorted(lm.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return {"weights_sha256": digest.hexdigest(), **settings}


def save_samples(path: Path, sets: dict[str, list[Sample]], key: dict) -> None:
    """Collected samples as plain tensors, with the key they were collected under."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"key": json.dumps(key, sort_keys=True)}
    for name, rows in sets.items():
        blob[name] = {"prompt": torch.tensor([s.prompt for s in rows], dtype=torch.long),
                      "features": torch.stack([s.features for s in rows]).half() if rows else torch.zeros(0),
                      "confidence": torch.tensor([s.confidence for s in rows]),
                      "label": torch.tensor([s.label for s in rows], dtype=torch.long)}
    torch.save(blob, path)


def load_samples(path: Path, key: dict) -> dict[str, list[Sample]] | None:
    """The samples saved at `path`, or None when there are none, or they were collected under another key
    (other weights or settings) or by an older version without one: the caller collects them anew."""
    if not path.exists():
        return None
    blob = torch.load(path)
    if blob.get("key") != json.dumps(key, sort_keys=True):
        return None
    return {name: [Sample(int(p), f.float(), float(c), int(y)) for p, f, c, y in
                   zip(t["prompt"], t["features"], t["confidence"], t["label"])]
            for name, t in blob.items() if isinstance(t, dict)}


def run_train_hrad(args) -> dict:
    """Collect samples from the target's greedy answers to training prompts, train, evaluate by prompt
    and on benchmark prompts, write weights + card."""
    from tqdm import tqdm

    from .config import GenerationConfig
    from .datasets import DATA_DIR, benchmark_prompts

    corpora = [Path(c) for c in args.corpus or [DATA_DIR / "teacher_smollm2_135m.jsonl",
                                                DATA_DIR / "self_smollm2_135m.jsonl",
                                                DATA_DIR / "self2_smollm2_135m.jsonl"]]
    for c in corpora:
        if not c.is_file():
            raise SpecBranchError(f"no corpus at {c}")
    rows = training_rows(corpora, args.limit, args.seed) if args.limit > 0 else []
    if len(rows) < 2:
        raise SpecBranchError(f"{len(rows)} usable rows (prompt_ids with a greedy response_ids) in "
                              f"{', '.join(map(str, corpora))} with --limit {args.limit}: H-RAD needs at least 2 "
                              "prompts to learn from and validate on")
    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise SpecBranchError(f"--out must name a .safetensors file, got {out}")
    engine = args.build_engine(args)
    samples_path = Path(args.samples)
    key = samples_key(engine.pair, {"corpora": [str(c) for c in corpora], "limit": args.limit, "seed": args.seed,
                                    "horizon": args.horizon, "held_out_limit": args.held_out_limit,
                                    "max_new_tokens": args.max_new_tokens,
                                    "draft_matmul": engine.pair.draft.matmul,  # the draft's confidences depend on
                                    "draft_lean": engine.pair.draft.lean})  # both (rounding)
    # reuse what was collected for this pair and these settings (to try other classifier settings)
    sets = load_samples(samples_path, key)
    if sets is None:
        if samples_path.exists():
            print(f"train-hrad: the samples at {samples_path} were collected for other weights or settings; "
                  "collecting anew", file=sys.stderr)
        train = [s for i, r in enumerate(tqdm(rows, desc="samples (training prompts)", unit="prompt"))
                 for s in forced_samples(engine.pair, r["prompt_ids"], r["response_ids"], args.horizon, i)]
        held_out = []
        for j, p in enumerate(benchmark_prompts("all", args.held_out_limit) if args.held_out_limit > 0 else []):
            ids = engine.encode(p.text, p.chat)
            reply = engine.run(ids, GenerationConfig(method="ar", max_new_tokens=args.max_new_tokens)).token_ids
            held_out += forced_samples(engine.pair, ids, reply, args.horizon, len(rows) + j)
        sets = {"train": train, "held_out": held_out}
        save_samples(samples_path, sets, key)
    if len({s.prompt for s in sets["train"]}) < 2:
        raise SpecBranchError(f"{len(sets['train'])} labelled samples from {len(rows)} prompts: too few to train "
                              "and validate by prompt (raise --limit)")
    train, val = split_by_prompt(sets["train"], args.val_fraction, args.seed)
    model = train_classifier(train, epochs=args.epochs, seed=args.seed, proj_dim=args.proj_dim, hidden=args.hidden,
                             dropout=args.dropout, weight_decay=args.weight_decay)
    meta = {"pair": pair_signature(engine.pair), "target": args.target, "draft": args.draft,
            "horizon": args.horizon, "train_prompts": len(rows), "epochs": args.epochs, "dropout": args.dropout,
            "weight_decay": args.weight_decay,
            "train_source": f"the target's greedy answers in {', '.join(c.name for c in corpora)} (training split; "
                            f"validation holds out {args.val_fraction:.0%} of these prompts)",
            "held_out_source": f"benchmark split, {args.held_out_limit} per dataset, the target's greedy answers "
                               f"of up to {args.max_new_tokens} tokens",
            **evaluate(model, train, {"validation_by_prompt": val, "held_out": sets["held_out"]})}
    save_hrad(model, out, meta)
    print(json.dumps(meta, indent=2))
    return meta


def add_arguments(p) -> None:
    p.add_argument("--corpus", action="append", help="training prompts (prompt_ids), repeatable (default: "
                   "data/teacher_smollm2_135m.jsonl, data/self_smollm2_135m.jsonl, data/self2_smollm2_135m.jsonl)")
    p.add_argument("--limit", type=int, default=600, help="training prompts (with the target's greedy answer) to read")
    p.add_argument("--held-out-limit", type=int, default=4, help="benchmark prompts per dataset for accuracy")
    p.add_argument("--horizon", type=int, default=4, help="accepted run at which a block counts as all accepted")
    p.add_argument("--val-fraction", type=float, default=0.2, help="training prompts held out for validation")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--proj-dim", type=int, default=8, help="PCA directions kept of the 5·H target features")
    p.add_argument("--hidden", type=int, default=64, help="MLP width")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--samples", default="runs/hrad/samples.pt",
                   help="collected samples, reused when collected for the same weights and settings")
    p.add_argument("--out", required=True, help="path of the .safetensors to write (a .json goes beside it)")
