"""H-RAD: a small classifier that reads the target's hidden state and the draft's confidence, and
predicts how the next drafted block will fare, so that SpecBranch knows where to branch.

Inputs (docs/specbranch.md (SpecBranch)): the target's hidden states from its last 4 layers at the last verified
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

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.config import SpecBranchError
from engine.drafts.shipped import DRAFTS_DIR, EMBEDDED_DRAFTS

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


def pair_signature(pair) -> dict:
    """What an H-RAD classifier depends on: the target's features and the draft's confidence."""

    def sig(lm):
        c = lm.model.config
        return {
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers,
            "vocab_rows": len(lm.head_ids) if lm.head_ids is not None else lm.vocab_size,
        }

    return {"target": sig(pair.target), "draft": sig(pair.draft)}


def save_hrad(model: HRAD, path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    path.with_suffix(".json").write_text(
        json.dumps(
            {"in_dim": model.in_dim, "proj_dim": model.proj_dim, "hidden": model.fc1.out_features, **meta}, indent=2
        )
    )


def load_hrad(path: Path, signature: dict) -> HRAD:
    """Load H-RAD weights; raises SpecBranchError if missing, of the old format, or made for another pair."""
    meta_path = path.with_suffix(".json")
    if not path.exists() or not meta_path.exists():
        raise SpecBranchError(f"no H-RAD weights at {path}")
    meta = json.loads(meta_path.read_text())
    for model in ("target", "draft"):
        made_for = meta.get("pair", {}).get(model)
        if made_for != signature[model]:
            diff = ", ".join(
                f"{k} {(made_for or {}).get(k, '?')} (this {model}: {v})"
                for k, v in signature[model].items()
                if (made_for or {}).get(k) != v
            )
            raise SpecBranchError(
                f"H-RAD weights at {path} were trained for another {model}: {diff}; "
                f"retrain them with `python -m engine train-hrad`"
            )
    model = HRAD(meta["in_dim"], meta["proj_dim"], meta["hidden"])
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def hrad_path_for(draft_name: str) -> Path | None:
    """Where a draft's H-RAD weights live: beside the draft's own weights."""
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
