"""Distilled drafts: a few transformer layers that borrow the target's embeddings and LM head.

On disk a draft is a directory with
  config.json         the draft's transformers config, plus a "specbranch_draft" entry
  model-NN.safetensors  only the draft's own weights (layers, final norm), bfloat16 (drafts/storage.py)
  vocab_subset.safetensors   (optional) ids of the reduced LM head, FR-Spec style
The shared tensors (embeddings, head) are taken from the target at load time, so a shipped draft
stays a few tens of MB. With a reduced head the draft's logits are -inf outside the subset, so q is
still a full-vocabulary distribution (zeros outside) and verification stays exact.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from engine.config import SpecBranchError
from engine.drafts.storage import load_vocab_subset, load_weights, save_vocab_subset, save_weights
from engine.models.devices import cast_model, same_device

SHARED_PREFIXES = ("model.embed_tokens.", "lm_head.")


def is_specbranch_draft(path: Path) -> bool:
    config = path / "config.json"
    return config.exists() and "specbranch_draft" in json.loads(config.read_text())


def draft_from_target(target, n_layers: int):
    """A draft of the target's class with its first n layers copied, sharing embeddings and head."""
    total = target.config.num_hidden_layers
    if not 1 <= n_layers < total:
        raise SpecBranchError(f"a draft needs 1 <= layers < {total} (the target's depth), got {n_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = n_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n_layers]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    draft = type(target)(config)
    own = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith(SHARED_PREFIXES) and (not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers)
    }
    draft.load_state_dict({k: v.clone() for k, v in own.items()}, strict=False)
    share_with_target(draft, target)
    return draft.eval()


def grown(draft, target, extra: int):
    """`draft` with `extra` decoder layers added on top (before its final norm), the same function at the start: each
    new layer is a copy of the target's layer at that depth with its attention and MLP output projections zeroed, so it
    adds nothing to the residual stream until trained (more capacity for a draft that has already learned)."""
    n = draft.config.num_hidden_layers
    if extra < 1 or n + extra >= target.config.num_hidden_layers:
        raise SpecBranchError(f"a grown draft needs 1 <= its new layers and {n} + them < the target's depth")
    bigger = draft_from_target(target, n + extra)
    state = {k: v for k, v in draft.state_dict().items() if not k.startswith(SHARED_PREFIXES)}
    bigger.load_state_dict(state, strict=False)  # its first n layers and final norm; the rest stay the target's
    with torch.no_grad():
        for layer in bigger.model.layers[n:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return bigger


def twin_of(target, skip: tuple[int, ...] = ()):
    """The target's architecture over the target's own weight tensors (assigned, not copied), in modules of its
    own: a self-draft whose matmuls read those weights through another kernel (lm_head.fast_linears routes a
    module's forward) then routes these modules, never the target's. `skip`: decoder layers left out (a
    layer-skipping self-draft, as in Draft & Verify, Zhang et al. 2023); the layers kept run in their order, with
    the target's final norm and head (models.skipped_layers checks a spec's indices)."""
    skipped = set(skip)
    keep = {old: new for new, old in enumerate(i for i in range(target.config.num_hidden_layers) if i not in skipped)}
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    twin = type(target)(config)
    renamed = {}  # the target's layer `old` becomes the twin's layer keep[old]
    for name, tensor in target.state_dict().items():
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            if int(index) in skipped:
                continue
            name = f"model.layers.{keep[int(index)]}.{rest}"
        renamed[name] = tensor
    twin.load_state_dict(renamed, assign=True)
    share_with_target(twin, target)
    return cast_model(twin, target.device).eval()


def share_with_target(draft, target) -> None:
    """Point the draft's embeddings and head at the target's modules (no copy). `load_pair` copies
    them instead when the draft sits on another device or dtype, since `.to()` would move the target's."""
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head


def own_state_dict(draft) -> dict[str, torch.Tensor]:
    return {k: v for k, v in draft.state_dict().items() if not k.startswith(SHARED_PREFIXES)}


def save_draft(draft, out: Path, vocab_subset: torch.Tensor | None, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = draft.config.to_dict()
    config["specbranch_draft"] = {
        "shared_from_target": list(SHARED_PREFIXES),
        "vocab_subset": vocab_subset is not None,
        **meta,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_weights(own_state_dict(draft), out)
    if vocab_subset is not None:
        save_vocab_subset(vocab_subset, out)


def load_draft_dir(path: Path, target, dtype: torch.dtype, device: torch.device):
    """Load a saved draft for `target`; returns (model, vocab_subset or None)."""
    from transformers import AutoConfig

    raw = json.loads((path / "config.json").read_text())
    info = raw.pop("specbranch_draft")
    config = AutoConfig.for_model(**raw)
    if config.hidden_size != target.config.hidden_size or config.vocab_size != target.config.vocab_size:
        raise SpecBranchError(
            f"draft {path} was trained for another target "
            f"(hidden {config.hidden_size}, vocab {config.vocab_size}; the target has "
            f"{target.config.hidden_size}, {target.config.vocab_size})"
        )
    draft = type(target)(config)
    missing, unexpected = draft.load_state_dict(load_weights(path, dtype), strict=False)
    missing = [k for k in missing if not k.startswith(SHARED_PREFIXES)]
    if missing or unexpected:
        raise SpecBranchError(f"draft {path} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    share_with_target(draft, target)
    subset = None
    if info.get("vocab_subset"):
        subset = load_vocab_subset(path).to(device)
    return place(draft, target, device, dtype), subset


def place(draft, target, device: torch.device, dtype: torch.dtype):
    """Move a draft that shares the target's embeddings/head; copy those first if it goes elsewhere (another device
    by its canonical name, devices.same_device: `cuda` is the target's `cuda:0` where GPU 0 is the current one) or
    into another dtype."""
    if not same_device(device, target.device) or dtype != target.dtype:
        draft.model.embed_tokens = copy.deepcopy(target.model.embed_tokens)
        draft.lm_head = copy.deepcopy(target.lm_head)
    return cast_model(draft, device, dtype).eval()  # its rotary table stays float32
