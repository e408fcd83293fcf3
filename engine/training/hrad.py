"""`python -m engine train-hrad`: train the H-RAD classifier (engine/methods/hrad.py) for a model pair.

Samples come from the target's greedy answers to training prompts, with no speculative run: one target pass and one
draft pass over prompt + response label every token the draft mispredicts (forced_samples). The features are shrunk
by a PCA projection fitted on the training samples; the classifier is validated by prompt and on benchmark prompts,
against the majority class and a rule on the draft's confidence alone.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import GenerationConfig, ModelSettings, SpecBranchError
from engine.methods.hrad import HRAD, features, pair_signature, save_hrad
from engine.training.common import read_jsonl, split_by_prompt


def label(run: int, horizon: int) -> int:
    return 0 if run == 0 else (2 if run >= horizon else 1)


@dataclass
class Sample:
    prompt: int  # which prompt it came from: validation splits by prompt, never by sample
    features: torch.Tensor  # [5H]
    confidence: float  # the draft's confidence in the first token it drafted after the verdict
    label: int


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
    return max(
        ((lo, hi) for lo in grid for hi in grid if hi >= lo),
        key=lambda t: macro_f1(confidence_rule(confidence, *t), gold),
    )


def scores(pred: torch.Tensor, gold: torch.Tensor) -> dict:
    return {
        "accuracy": round(float((pred == gold).float().mean()), 4) if len(gold) else None,
        "macro_f1": round(macro_f1(pred, gold), 4) if len(gold) else None,
    }


def tensors(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.stack([s.features for s in samples]).float(),
        torch.tensor([s.confidence for s in samples]),
        torch.tensor([s.label for s in samples]),
    )


def train_classifier(
    train: list[Sample],
    epochs: int = 30,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    proj_dim: int = 8,
    hidden: int = 64,
    dropout: float = 0.2,
    weight_decay: float = 0.01,
) -> HRAD:
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
            idx = order[i : i + batch_size]
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
    report = {
        "class_counts_train": torch.bincount(y_train, minlength=3).tolist(),
        "confidence_rule": {"low": low, "high": high},
    }
    for name, rows in {"train": train, **sets}.items():
        if not rows:
            report[name] = None
            continue
        x, conf, y = tensors(rows)
        with torch.inference_mode():
            pred = model(x, conf).argmax(-1)
        report[name] = {
            "samples": len(rows),
            "class_counts": torch.bincount(y, minlength=3).tolist(),
            "hrad": scores(pred, y),
            "majority": scores(torch.full_like(y, majority), y),
            "confidence_only": scores(confidence_rule(conf, low, high), y),
        }
    return report


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
    d_logits = draft.forward(ids, draft.new_cache())[0, len(prompt_ids) - 1 :].float()  # row j predicts response[j]
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
        samples.append(
            Sample(
                prompt, features(out.hidden_states, position, emb[position + 1]), confidence[t + 1], label(run, horizon)
            )
        )
    return samples


def training_rows(corpora: list[Path], limit: int, seed: int) -> list[dict]:
    """Up to `limit` distinct training-split prompts with the target's greedy response, the same number
    from each source (GSM8K, HumanEval, MT-Bench second turns, the target's own questions), so that the
    classifier does not learn only GSM8K's rhythm."""
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
        blob[name] = {
            "prompt": torch.tensor([s.prompt for s in rows], dtype=torch.long),
            "features": torch.stack([s.features for s in rows]).half() if rows else torch.zeros(0),
            "confidence": torch.tensor([s.confidence for s in rows]),
            "label": torch.tensor([s.label for s in rows], dtype=torch.long),
        }
    torch.save(blob, path)


def load_samples(path: Path, key: dict) -> dict[str, list[Sample]] | None:
    """The samples saved at `path`, or None when there are none, or they were collected under another key
    (other weights or settings) or by an older version without one: the caller collects them anew."""
    if not path.exists():
        return None
    blob = torch.load(path)
    if blob.get("key") != json.dumps(key, sort_keys=True):
        return None
    return {
        name: [
            Sample(int(p), f.float(), float(c), int(y))
            for p, f, c, y in zip(t["prompt"], t["features"], t["confidence"], t["label"])
        ]
        for name, t in blob.items()
        if isinstance(t, dict)
    }


@dataclass(frozen=True)
class HradSpec:
    """What `python -m engine train-hrad` collects, trains and writes (the flags of the same names)."""

    out: str  # the .safetensors to write (a .json goes beside it)
    corpus: list[str] | None = None  # training prompts with the target's greedy answers (None: DEFAULT_CORPORA)
    limit: int = 600  # training prompts to read
    held_out_limit: int = 4  # benchmark prompts per dataset for accuracy
    horizon: int = 4  # accepted run at which a block counts as all accepted
    val_fraction: float = 0.2  # training prompts held out for validation
    epochs: int = 30
    proj_dim: int = 8  # PCA directions kept of the 5·H target features
    hidden: int = 64  # MLP width
    dropout: float = 0.2
    weight_decay: float = 0.01
    samples: str = "runs/hrad/samples.pt"  # collected samples, reused for the same weights and settings
    seed: int = 0
    max_new_tokens: int = 128  # the held-out prompts' greedy answers


DEFAULT_CORPORA = ("teacher_smollm2_135m.jsonl.gz", "self_smollm2_135m.jsonl.gz", "self2_smollm2_135m.jsonl.gz")


def checked_rows(spec: HradSpec) -> tuple[list[Path], list[dict]]:
    """(corpora, the training rows read from them), refused before any model loads where they cannot serve."""
    from engine.measure.datasets import DATA_DIR

    corpora = [Path(c) for c in spec.corpus or [DATA_DIR / name for name in DEFAULT_CORPORA]]
    for c in corpora:
        if not c.is_file():
            raise SpecBranchError(f"no corpus at {c}")
    rows = training_rows(corpora, spec.limit, spec.seed) if spec.limit > 0 else []
    if len(rows) < 2:
        raise SpecBranchError(
            f"{len(rows)} usable rows (prompt_ids with a greedy response_ids) in "
            f"{', '.join(map(str, corpora))} with --limit {spec.limit}: H-RAD needs at least 2 "
            "prompts to learn from and validate on"
        )
    if Path(spec.out).suffix != ".safetensors":
        raise SpecBranchError(f"--out must name a .safetensors file, got {Path(spec.out)}")
    return corpora, rows


def collect_samples(spec: HradSpec, engine, rows: list[dict]) -> dict[str, list[Sample]]:
    """{"train": samples of the training rows, "held_out": of the target's greedy answers to benchmark prompts}."""
    from tqdm import tqdm

    from engine.measure.datasets import benchmark_prompts

    train = [
        s
        for i, r in enumerate(tqdm(rows, desc="samples (training prompts)", unit="prompt"))
        for s in forced_samples(engine.pair, r["prompt_ids"], r["response_ids"], spec.horizon, i)
    ]
    held_out = []
    for j, p in enumerate(benchmark_prompts("all", spec.held_out_limit) if spec.held_out_limit > 0 else []):
        ids = engine.encode(p.text, p.chat)
        reply = engine.run(ids, GenerationConfig(method="ar", max_new_tokens=spec.max_new_tokens)).token_ids
        held_out += forced_samples(engine.pair, ids, reply, spec.horizon, len(rows) + j)
    return {"train": train, "held_out": held_out}


def samples_for(spec: HradSpec, engine, corpora: list[Path], rows: list[dict]) -> dict[str, list[Sample]]:
    """The samples saved for this pair and these settings (to try other classifier settings), else collected and
    saved."""
    samples_path = Path(spec.samples)
    settings = {
        "corpora": [str(c) for c in corpora],
        "limit": spec.limit,
        "seed": spec.seed,
        "horizon": spec.horizon,
        "held_out_limit": spec.held_out_limit,
        "max_new_tokens": spec.max_new_tokens,
        "draft_matmul": engine.pair.draft.matmul,  # the draft's confidences depend on both (rounding)
        "draft_lean": engine.pair.draft.lean,
    }
    key = samples_key(engine.pair, settings)
    sets = load_samples(samples_path, key)
    if sets is None:
        if samples_path.exists():
            print(
                f"train-hrad: the samples at {samples_path} were collected for other weights or settings; "
                "collecting anew",
                file=sys.stderr,
            )
        sets = collect_samples(spec, engine, rows)
        save_samples(samples_path, sets, key)
    return sets


def run_train_hrad(spec: HradSpec, models: ModelSettings) -> dict:
    """Collect samples from the target's greedy answers to training prompts, train, evaluate by prompt
    and on benchmark prompts, write weights + card."""
    from engine.load import load_engine

    corpora, rows = checked_rows(spec)
    engine = load_engine(models, need_draft=True)
    sets = samples_for(spec, engine, corpora, rows)
    if len({s.prompt for s in sets["train"]}) < 2:
        raise SpecBranchError(
            f"{len(sets['train'])} labelled samples from {len(rows)} prompts: too few to train "
            "and validate by prompt (raise --limit)"
        )
    train, val = split_by_prompt(sets["train"], spec.val_fraction, spec.seed, prompt_of=lambda s: s.prompt)
    model = train_classifier(
        train,
        epochs=spec.epochs,
        seed=spec.seed,
        proj_dim=spec.proj_dim,
        hidden=spec.hidden,
        dropout=spec.dropout,
        weight_decay=spec.weight_decay,
    )
    meta = {
        "pair": pair_signature(engine.pair),
        "target": models.target,
        "draft": models.draft,
        "horizon": spec.horizon,
        "train_prompts": len(rows),
        "epochs": spec.epochs,
        "dropout": spec.dropout,
        "weight_decay": spec.weight_decay,
        "train_source": f"the target's greedy answers in {', '.join(c.name for c in corpora)} (training split; "
        f"validation holds out {spec.val_fraction:.0%} of these prompts)",
        "held_out_source": f"benchmark split, {spec.held_out_limit} per dataset, the target's greedy answers "
        f"of up to {spec.max_new_tokens} tokens",
        **evaluate(model, train, {"validation_by_prompt": val, "held_out": sets["held_out"]}),
    }
    save_hrad(model, Path(spec.out), meta)
    print(json.dumps(meta, indent=2))
    return meta
