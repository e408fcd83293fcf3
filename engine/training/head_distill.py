"""`python -m engine distill --kind head`: train a feature-conditioned draft head (engine/drafts/head.py).

Two resumable stages in --work-dir, after distill's own generate stage:
  features  the target's post-norm last hidden state at every position of every (prompt, response) row,
            float16, in chunk files (one target forward per batch; bfloat16 autocast on CPU for speed)
  train     the head, unrolled on its own predictions ("training-time test", EAGLE-3): unroll step j
            feeds the head its step j-1 predictions and attends exactly as drafting at depth j+1 does
            (to the true-feature rows up to t-j and to its own chain after that). Loss per step: the
            target's distribution over the reduced vocabulary (from the true feature, so no labels are
            stored) against the head's, plus a smooth-L1 pull of the predicted feature to the true one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.drafts.head import FeatureHead, save_head
from engine.training.common import (
    DistillSpec,
    Optimiser,
    Progress,
    batches,
    capped_rows,
    frequent_vocab,
    split_by_prompt,
)

CHUNK_ROWS = 256


def autocast(device: torch.device):
    """bfloat16 matmuls where they pay (CPU with avx512-bf16 measured 2.2x fp32 here; CUDA)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@torch.inference_mode()
def extract_features(target, rows: list[dict], work: Path, batch_size: int = 8) -> list[torch.Tensor]:
    """Per row: [len(prompt) + len(response), H] float16 post-norm features. Chunks already on disk are kept."""
    device = next(target.parameters()).device
    out: list[torch.Tensor | None] = [None] * len(rows)
    for c0 in tqdm(range(0, len(rows), CHUNK_ROWS), desc="features", unit="chunk"):
        path = work / f"features_{len(rows)}_{c0:06d}.pt"
        part = rows[c0 : c0 + CHUNK_ROWS]
        if path.exists():
            saved = torch.load(path)
            if len(saved) == len(part):
                out[c0 : c0 + len(part)] = saved
                continue
        feats: list[torch.Tensor | None] = [None] * len(part)
        for chunk, ids, mask in batches(part, batch_size, shuffle=False):
            with autocast(device):
                hidden = target.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            for b, i in enumerate(chunk):
                n = len(part[i]["prompt_ids"]) + len(part[i]["response_ids"])
                feats[i] = hidden[b, :n].to("cpu", torch.float16).clone()
        torch.save(feats, path)
        out[c0 : c0 + len(part)] = feats
    return out


def feature_batches(rows, feats, batch_size: int, shuffle: bool, seed: int, device="cpu"):
    """Length-bucketed batches on `device`: ids [B, T], true features [B, T, H] (float32), loss mask [B, T]
    (rows that predict a response token)."""
    for chunk, ids, _ in batches(rows, batch_size, shuffle, seed):
        t = ids.shape[1]
        f = torch.zeros(len(chunk), t, feats[chunk[0]].shape[-1])
        loss_mask = torch.zeros(len(chunk), t, dtype=torch.bool)
        for b, i in enumerate(chunk):
            n = feats[i].shape[0]
            f[b, :n] = feats[i].float()
            p, r = len(rows[i]["prompt_ids"]), len(rows[i]["response_ids"])
            loss_mask[b, p - 1 : p + r - 1] = True
        yield ids.to(device), f.to(device), loss_mask.to(device)


def ttt_mask(t: int, step: int, device=None) -> torch.Tensor:
    """bool [1, 1, t, (step + 1) * t]: at unroll step j, query t sees step-0 keys at s <= t - j, the step-i
    key at s = t - j + i for 0 < i < j, and its own key (step j, s = t)."""
    q = torch.arange(t, device=device)[:, None]
    s = torch.arange(t, device=device)[None, :]
    blocks = [s <= q - step] + [s == q - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)[None, None]


def unrolled_outputs(head: FeatureHead, embeds: torch.Tensor, true_feats: torch.Tensor, steps: int):
    """The head's predictions at depths 1..steps for every position: a list of [B, T, H]."""
    from transformers import DynamicCache

    b, t, _ = embeds.shape
    cache = DynamicCache(config=head.config)
    position_ids = torch.arange(t, device=embeds.device)[None]
    prev = true_feats
    outs = []
    for j in range(steps):
        feats_in = F.pad(prev[:, :-1], (0, 0, 1, 0))  # row r reads f_{r-1}; row 0 reads zeros
        out = head(embeds, feats_in, position_ids, ttt_mask(t, j, embeds.device), cache)
        outs.append(out)
        prev = out
    return outs


def losses(outs, true_feats, loss_mask, sub_head: torch.Tensor, reg_weight: float):
    """Per unroll step: soft cross-entropy against the target's reduced-vocabulary distribution, smooth L1 on
    the feature, and greedy agreements (argmax equal) at the rows in loss_mask."""
    with torch.no_grad():
        p = (true_feats[loss_mask] @ sub_head.T).float().softmax(-1)  # [N, S]
        target_top = p.argmax(-1)
    total, agree = 0.0, []
    for j, out in enumerate(outs):
        # rows t < j have no chain of j steps behind them: leave them out
        valid = loss_mask.clone()
        valid[:, :j] = False
        keep = valid[loss_mask]
        logq = (out[loss_mask] @ sub_head.T).float().log_softmax(-1)
        ce = -(p[keep] * logq[keep]).sum(-1).mean()
        reg = F.smooth_l1_loss(out[valid].float(), true_feats[valid])
        total = total + ce + reg_weight * reg
        agree.append((int((logq[keep].argmax(-1) == target_top[keep]).sum()), int(keep.sum())))
    return total / len(outs), agree


def evaluate(head, rows, feats, embed, sub_head, steps: int, batch_size: int) -> list[float]:
    """Held-out greedy agreement with the target at drafting depths 1..steps (conditional on the chain so far)."""
    head.eval()
    a, n = [0] * steps, [0] * steps
    with torch.inference_mode():
        for ids, f, m in feature_batches(rows, feats, batch_size, False, 0, next(head.parameters()).device):
            outs = unrolled_outputs(head, embed(ids).float(), f, steps)
            _, agree = losses(outs, f, m, sub_head, 0.0)
            for j, (x, y) in enumerate(agree):
                a[j] += x
                n[j] += y
    head.train()
    return [round(x / max(y, 1), 4) for x, y in zip(a, n)]


@dataclass
class HeadTraining:
    """What each step of a head's training reads: the head, the target's embeddings and reduced head rows, the
    unroll depth and the loss's weight on the feature."""

    head: FeatureHead
    embed: torch.nn.Module
    sub_head: torch.Tensor  # [|subset|, H]
    steps: int
    reg_weight: float
    device: torch.device

    def evaluate(self, rows, feats, batch_size: int) -> list[float]:
        return evaluate(self.head, rows, feats, self.embed, self.sub_head, self.steps, batch_size)

    def epoch(self, rows, feats, optimiser: Optimiser, progress: Progress, batch_size: int, seed: int) -> bool:
        """One epoch's steps, fewer where the budget runs out; returns whether it ran out."""
        for ids, f, m in feature_batches(rows, feats, batch_size, True, seed, self.device):
            with autocast(self.device):
                outs = unrolled_outputs(self.head, self.embed(ids).float(), f, self.steps)
                loss, agree = losses(outs, f, m, self.sub_head, self.reg_weight)
            optimiser.step(loss)
            progress.advance(loss=f"{loss.item():.3f}", d1=f"{agree[0][0] / max(agree[0][1], 1):.3f}")
            if progress.step % 25 == 0:
                progress.write(
                    step=progress.step,
                    epoch=progress.epoch,
                    loss=round(loss.item(), 4),
                    train_agreement_by_depth=[round(x / max(y, 1), 4) for x, y in agree],
                    lr=optimiser.lr,
                    minutes=progress.minutes,
                )
            if progress.spent():
                return True
        return False


def train_head(target, rows, feats, val_rows, val_feats, spec: DistillSpec, log_path: Path, reg_weight: float = 0.5):
    """A feature-conditioned head trained on the target's features of `rows` (spec: its layers, vocabulary, unroll
    depth, epochs, learning rate, batch size, seed and time budget): (head, its vocabulary subset, a summary)."""
    epochs, batch_size, seed = spec.epochs, spec.batch_size, spec.seed
    torch.manual_seed(seed)
    device = next(target.parameters()).device
    head = FeatureHead.from_target(target, spec.layers).float().to(device).train()
    subset = frequent_vocab(rows, spec.vocab, target.get_output_embeddings().weight.shape[0])
    sub_head = target.get_output_embeddings().weight[subset].detach().float().contiguous()
    run = HeadTraining(head, target.get_input_embeddings(), sub_head, spec.unroll, reg_weight, device)
    per_epoch = math.ceil(len(rows) / batch_size)
    total_steps = max(1, int(epochs * per_epoch))
    optimiser = Optimiser.warm_cosine(
        [p for p in head.parameters() if p.requires_grad], spec.lr, total_steps, warmup=50
    )
    with open(log_path, "w") as log:
        val = run.evaluate(val_rows, val_feats, batch_size)
        progress = Progress(log, total_steps, per_epoch, spec.max_minutes)
        progress.write(step=0, val_agreement_by_depth=val)
        progress.open_bar("train head")
        for epoch in range(math.ceil(epochs)):
            stopped = run.epoch(rows, feats, optimiser, progress, batch_size, seed + epoch)
            val = run.evaluate(val_rows, val_feats, batch_size)
            progress.write(step=progress.step, epoch=progress.epoch, val_agreement_by_depth=val)
            tqdm.write(f"epoch {epoch + 1}: held-out agreement by depth {val}")
            if stopped:
                break
        progress.bar.close()
    return head.eval(), subset, {"val_agreement_by_depth": val, "steps": progress.step, "minutes": progress.minutes}


def run_head_distill(spec: DistillSpec, target, rows: list[dict], work: Path) -> dict:
    """Stages features and train for --kind head; saves the head to spec.out with its card's facts."""
    torch.manual_seed(spec.seed)
    train_rows, val_rows = split_by_prompt(rows, spec.val_fraction, spec.seed)
    ordered = train_rows + val_rows
    feats = extract_features(target, ordered, work, spec.label_batch_size)
    train_feats, val_feats = feats[: len(train_rows)], feats[len(train_rows) :]
    if spec.max_tokens:  # a data-size curve: fewer training rows, the same held-out rows
        kept = capped_rows(train_rows, spec.max_tokens, spec.seed)
        train_rows, train_feats = [train_rows[i] for i in kept], [train_feats[i] for i in kept]
    n_tokens = sum(len(r["response_ids"]) for r in train_rows)
    print(
        f"distill --kind head: {len(train_rows)} training rows ({n_tokens} response tokens), {len(val_rows)} held out"
    )
    head, subset, summary = train_head(
        target, train_rows, train_feats, val_rows, val_feats, spec, work / "train_head_log.jsonl"
    )
    meta = {
        "kind": "head",
        "target": spec.target,
        "target_layers": target.config.num_hidden_layers,
        "layers": spec.layers,
        "unroll": spec.unroll,
        "vocab_subset_size": int(len(subset)),
        "train_rows": len(train_rows),
        "train_response_tokens": n_tokens,
        "held_out_rows": len(val_rows),
        **spec.training_meta(),
        **summary,
    }
    save_head(head, Path(spec.out), subset, meta)
    (Path(spec.out) / "training_log.jsonl").write_text((work / "train_head_log.jsonl").read_text())
    print(json.dumps(meta))
    return meta
