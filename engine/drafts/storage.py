"""How a shipped draft's weights are stored: one byte a weight, loaded into the model's dtype.

Each matrix is stored as int8 with one float32 scale per output row (absmax / 127: a row's largest weight comes back to
float32 rounding, every other within half a step); vectors (norms, biases) stay float16. That halves the float16 files
the
drafts were trained into, so the shipped drafts come to about 31 MiB in all (a device call sends at most 64 MiB);
their acceptance with the target is unchanged within noise (docs/models.md). bfloat16 would not help: float16 is
already two bytes a weight. Files of other floating dtypes (drafts saved before, or elsewhere) load the same way:
every tensor is cast to the model's dtype at load. Files are split at MAX_SHARD_BYTES so each stays small."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MAX_SHARD_BYTES = 24 * 2**20
PATTERN = "model*.safetensors"
VOCAB_SUBSET = "vocab_subset.safetensors"  # a reduced LM head's token ids
SCALE = "@scale"  # key suffix of a matrix's per-row scales: [rows] float32 beside its int8 codes [rows, cols]


def shards(weights: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Split a state dict, in key order, into groups of at most `limit` bytes (one tensor may exceed it); a matrix's
    scales stay in the file of its codes."""
    out, size = [{}], 0
    for name in sorted(k for k in weights if not k.endswith(SCALE)):
        group = {name: weights[name]} | ({name + SCALE: weights[name + SCALE]} if name + SCALE in weights else {})
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if out[-1] and size + nbytes > limit:
            out.append({})
            size = 0
        out[-1].update(group)
        size += nbytes
    return out


def encode(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A tensor as stored: a matrix [rows, cols] as int8 codes and float32 row scales, anything else float16."""
    w = w.detach().to("cpu", torch.float32)
    if w.ndim != 2:
        return {name: w.to(torch.float16).contiguous()}
    scale = w.abs().amax(dim=1) / 127  # [rows]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {name: codes.contiguous(), name + SCALE: scale.contiguous()}


def decode(stored: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Stored tensors back as `dtype`: int8 codes times their row scales; other tensors cast."""
    out = {}
    for name, t in stored.items():
        if name.endswith(SCALE):
            continue
        if name + SCALE in stored:
            t = t.to(torch.float32) * stored[name + SCALE][:, None]
        out[name] = t.to(dtype)
    return out


def save_weights(weights: dict[str, torch.Tensor], out: Path) -> None:
    """Write `weights` (floating tensors) into out/model-NN.safetensors, encoded, replacing older files."""
    out.mkdir(parents=True, exist_ok=True)
    stored = {k: v for name, w in weights.items() for k, v in encode(name, w).items()}
    for old in out.glob(PATTERN):
        old.unlink()
    for i, shard in enumerate(shards(stored, MAX_SHARD_BYTES)):
        save_file(shard, str(out / f"model-{i:02d}.safetensors"), metadata={"format": "pt", "matrices": "int8-rows"})


def load_weights(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of path/model-NN.safetensors, decoded to `dtype`."""
    stored = {}
    for file in sorted(path.glob(PATTERN)):
        stored.update(load_file(str(file)))
    return decode(stored, dtype)


def save_vocab_subset(ids: torch.Tensor, out: Path) -> None:
    """A reduced LM head's token ids, as int32 (a vocabulary is far below 2**31 ids; half int64's bytes), into
    out/vocab_subset.safetensors."""
    save_file({"ids": ids.to(torch.int32).cpu().contiguous()}, str(out / VOCAB_SUBSET))


def load_vocab_subset(path: Path) -> torch.Tensor:
    """The ids save_vocab_subset wrote (or an older int64 file), as int64 [n]: what indexing the LM head takes."""
    return load_file(str(path / VOCAB_SUBSET))["ids"].long()
