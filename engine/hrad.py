"""H-RAD: a small MLP that reads the target's hidden state and predicts how the next drafted block
will fare, so that SpecBranch knows where to branch.

Features (SPECBRANCH.md §3): the target's hidden states from its last 4 layers at the last verified
position, concatenated with the embedding of the next token (the correction just committed).
Classes, from the run of draft tokens accepted after that position before the next rejection:
  0  rejected at once (run = 0)        -> branch at the very first draft token
  1  partly accepted (0 < run < L)     -> draft while confident, branch at the first token below ε
  2  all accepted   (run >= L)         -> draft linearly, no branch this round
L is the label horizon (default 4). The classifier runs after each verdict that discards the
speculation, i.e. whenever the draft starts afresh from the committed tokens.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import SpecBranchError

N_LAYERS = 4


class HRAD(torch.nn.Module):
    def __init__(self, in_dim: int, hidden: int = 256, dropout: float = 0.0):
        super().__init__()
        self.in_dim, self.dropout = in_dim, dropout
        self.net = torch.nn.Sequential(torch.nn.LayerNorm(in_dim), torch.nn.Linear(in_dim, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[:3](x)  # dropout only while training: a few thousand samples of 2880 features overfit fast
        return self.net[3](torch.nn.functional.dropout(h, self.dropout, self.training))

    @torch.inference_mode()
    def predict(self, features: torch.Tensor) -> int:
        return int(self(features.float()[None]).argmax(-1))


def features(hidden_states: tuple, position: int, next_embedding: torch.Tensor) -> torch.Tensor:
    """[4 * H + H] feature vector on CPU: last-4-layer states at `position` (batch row 0) + next-token embedding."""
    parts = [h[0, position].float().cpu() for h in hidden_states[-N_LAYERS:]]
    return torch.cat(parts + [next_embedding.float().cpu()])


def label(run: int, horizon: int) -> int:
    return 0 if run == 0 else (2 if run >= horizon else 1)


def labelled_samples(samples: list[tuple[int, torch.Tensor]], kinds: list[str], horizon: int):
    """Pair each (emitted index of a correction, features) with the class of the accepted run after it.
    Runs cut short by the end of the output (shorter than the horizon) are dropped as unknown."""
    out = []
    for index, feats in samples:
        run = 0
        for k in kinds[index + 1:]:
            if k not in ("accepted", "rescued"):
                break
            run += 1
        ended = index + 1 + run >= len(kinds)
        if ended and run < horizon:
            continue
        out.append((feats, label(run, horizon)))
    return out


def save_hrad(model: HRAD, path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(json.dumps({"in_dim": model.in_dim, **meta}, indent=2))


def load_hrad(path: Path, target_hidden: int) -> HRAD:
    """Load H-RAD weights; raises SpecBranchError if missing or made for another target."""
    meta_path = path.with_suffix(".json")
    if not path.exists() or not meta_path.exists():
        raise SpecBranchError(f"no H-RAD weights at {path}")
    meta = json.loads(meta_path.read_text())
    if meta.get("in_dim") != (N_LAYERS + 1) * target_hidden:
        raise SpecBranchError(f"H-RAD weights at {path} were trained for hidden size {meta.get('in_dim', 0) // 5}, "
                              f"the target has {target_hidden}")
    state = load_file(str(path))
    model = HRAD(meta["in_dim"], state["net.1.weight"].shape[0])
    model.load_state_dict(state)
    return model.eval()


def train_classifier(train: list, val: list, epochs: int = 20, batch_size: int = 32, lr: float = 1e-3,
                     seed: int = 0, hidden: int = 256, dropout: float = 0.0,
                     weight_decay: float = 0.01) -> tuple[HRAD, dict]:
    """Train the 3-way MLP (class-balanced loss); report accuracy against the majority class."""
    torch.manual_seed(seed)
    x = torch.stack([f for f, _ in train])
    y = torch.tensor([c for _, c in train])
    counts = torch.bincount(y, minlength=3).float()
    weights = counts.sum() / (3 * counts.clamp_min(1))
    model = HRAD(x.shape[1], hidden, dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    order = list(range(len(train)))
    model.train()
    for epoch in range(epochs):
        random.Random(seed + epoch).shuffle(order)
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], weight=weights)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()

    def accuracy(rows):
        if not rows:
            return None
        with torch.inference_mode():
            pred = model(torch.stack([f for f, _ in rows])).argmax(-1)
        return round(float((pred == torch.tensor([c for _, c in rows])).float().mean()), 4)

    majority = int(counts.argmax())
    report = {"train_samples": len(train), "held_out_samples": len(val),
              "class_counts_train": counts.int().tolist(),
              "class_counts_held_out": torch.bincount(torch.tensor([c for _, c in val] or [0]), minlength=3).tolist()
              if val else [0, 0, 0],
              "train_accuracy": accuracy(train), "held_out_accuracy": accuracy(val),
              "held_out_majority_baseline": round(sum(c == majority for _, c in val) / len(val), 4) if val else None}
    return model, report


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
    path = hrad_path_for(pair.draft.name)
    if path is None:
        return None, f"no H-RAD weights for draft {pair.draft.name!r}"
    try:
        return load_hrad(path, pair.target.model.config.hidden_size), ""
    except SpecBranchError as exc:
        return None, str(exc)


def collect(engine, prompts: list[list[int]], cfg, horizon: int, desc: str) -> list:
    """Run SpecBranch (confidence only) on prompts and return labelled (features, class) samples."""
    from tqdm import tqdm

    samples = []
    for ids in tqdm(prompts, desc=desc, unit="prompt"):
        raw: list = []
        result = engine.run(ids, cfg, collect_hrad=raw)
        kinds = [k for e in result.events if e.type == "tokens_emitted" for k in e.kinds]
        samples += labelled_samples(raw, kinds, horizon)
    return samples


def training_prompts(corpora: list[Path], limit: int, seed: int) -> list[list[int]]:
    """Distinct training-split prompts, the same number from each source (GSM8K, HumanEval, MT-Bench
    second turns, the target's own questions), so the classifier does not learn only GSM8K's rhythm."""
    from .distill import read_jsonl

    by_source: dict[str, list[list[int]]] = {}
    seen = set()
    for r in (row for corpus in corpora for row in read_jsonl(corpus)):
        key = tuple(r["prompt_ids"])
        if key not in seen:
            seen.add(key)
            by_source.setdefault(r.get("source", ""), []).append(list(key))
    rng = random.Random(seed)
    picked = []
    for source in sorted(by_source):
        rng.shuffle(by_source[source])
        picked += by_source[source][: max(1, limit // len(by_source))]
    return picked


def run_train_hrad(args) -> dict:
    from .config import GenerationConfig
    from .datasets import DATA_DIR, benchmark_prompts

    args.corpus = args.corpus or [str(DATA_DIR / "teacher_smollm2_135m.jsonl"), str(DATA_DIR / "self_smollm2_135m.jsonl")]
    engine = args.build_engine(args)
    cfg = GenerationConfig(method="specbranch-no-hrad", max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                           branches=args.branches, epsilon=args.epsilon, temperature=0.0).validate()
    samples_path = Path(args.samples)
    if samples_path.exists():  # collecting is the slow part: reuse it to try other classifier settings
        train, val, train_prompts = torch.load(samples_path)
    else:
        train_prompts = training_prompts([Path(c) for c in args.corpus], args.limit, args.seed)
        held_out = [engine.encode(p.text, p.chat) for p in benchmark_prompts("all", args.held_out_limit)]
        train = collect(engine, train_prompts, cfg, args.horizon, "collect (training prompts)")
        val = collect(engine, held_out, cfg, args.horizon, "collect (held-out benchmark prompts)")
        samples_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save((train, val, train_prompts), samples_path)
    model, report = train_classifier(train, val, epochs=args.epochs, seed=args.seed, hidden=args.hidden,
                                     dropout=args.dropout, weight_decay=args.weight_decay)
    meta = {"target": args.target, "draft": args.draft, "horizon": args.horizon, "gamma": args.gamma,
            "epsilon": args.epsilon, "train_prompts": len(train_prompts), "hidden": args.hidden,
            "dropout": args.dropout, "weight_decay": args.weight_decay, "epochs": args.epochs,
            "train_source": f"{', '.join(args.corpus)} (training split)",
            "held_out_source": f"benchmark split, {args.held_out_limit} per dataset", **report}
    save_hrad(model, Path(args.out), meta)
    print(json.dumps(meta, indent=2))
    return meta


def add_arguments(p) -> None:
    p.add_argument("--corpus", action="append", help="training prompts (prompt_ids), repeatable "
                   "(default: data/teacher_smollm2_135m.jsonl and data/self_smollm2_135m.jsonl)")
    p.add_argument("--limit", type=int, default=80, help="training prompts to run")
    p.add_argument("--held-out-limit", type=int, default=6, help="benchmark prompts per dataset for accuracy")
    p.add_argument("--horizon", type=int, default=4, help="accepted run at which a block counts as all accepted")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--hidden", type=int, default=64, help="MLP width")
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--samples", default="runs/hrad-samples.pt", help="collected samples, reused when present")
    p.add_argument("--out", required=True, help="path of the .safetensors to write (a .json goes beside it)")
