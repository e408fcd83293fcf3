"""Devices and casts, each in one place: a device's canonical name, and a model moved or cast with its rotary tables
kept in float32.

canonical_device: torch names the current GPU both `cuda` and `cuda:0`, and torch.device("cuda") != torch.device("cuda",
0). A tensor on a GPU always reports the indexed name, so a device given as `cuda` compared with a model's device says
"elsewhere" where it is the same GPU (drafts.distilled.place then gave a draft its own copy of the target's embeddings
and head). Every device the engine picks (models.pick_device) or compares (same_device) goes through here, and so
should the workers' (runtime.Worker): `cuda` becomes `cuda:<current device>`; other devices are left as they are.

cast_model: `module.to(dtype=...)` casts every floating-point buffer, the rotary embedding's `inv_freq` (and
`original_inv_freq`) among them. transformers keeps those in float32 whatever the weights' dtype (from_pretrained with a
bfloat16 dtype leaves them float32, and the rotary forward computes its cos and sin in float32 from them); a draft or a
head cast to bfloat16 by `.to()` had them rounded to bfloat16, so its positions rotated otherwise than the target's.
cast_model moves or casts a module and puts those buffers back in float32, with their float32 values.
"""

from __future__ import annotations

import torch

ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")  # transformers' rotary modules' tables


def canonical_device(device: torch.device | str | None) -> torch.device:
    """`device` with the index a tensor placed there would report: `cuda` -> `cuda:<current device>`; `cpu`, an
    indexed device and other types as they are. None is the CPU."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def same_device(a: torch.device | str | None, b: torch.device | str | None) -> bool:
    """Whether a and b name the same device (`cuda` and `cuda:0` do, where GPU 0 is the current one)."""
    return canonical_device(a) == canonical_device(b)


def rotary_buffers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """(owner, name) of every rotary-table buffer in `module` (transformers' inv_freq and original_inv_freq)."""
    return [
        (m, name)
        for m in module.modules()
        for name, buf in m.named_buffers(recurse=False)
        if name in ROTARY_BUFFERS and buf is not None
    ]


def _fresh_table(owner: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The float32 table a rotary module computes from its config (for a buffer already rounded by a cast made
    elsewhere), or None where the module does not say how."""
    config = getattr(owner, "config", None)
    rope_type = getattr(owner, "rope_type", "default")
    try:
        if rope_type == "default" and hasattr(owner, "compute_default_rope_parameters"):
            inv, _ = owner.compute_default_rope_parameters(config)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv, _ = ROPE_INIT_FUNCTIONS[rope_type](config)
    except Exception:  # noqa: BLE001 - an unknown module or rope type: the caller upcasts what it has
        return None
    return inv.float()


def cast_model(
    module: torch.nn.Module, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """module.to(device, dtype) (either may be None: left as it is), with its rotary tables (rotary_buffers) kept in
    float32 on the new device, holding their float32 values. Returns the module (cast in place, as .to() does)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in rotary_buffers(module)]
    kwargs = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    if kwargs:
        module.to(**kwargs)
    for owner, name, old in saved:
        if old.dtype != torch.float32:  # rounded before it came here: recompute it where the module says how
            fresh = _fresh_table(owner, name)
            old = fresh if fresh is not None and fresh.shape == old.shape else old.float()
        new = getattr(owner, name)
        setattr(owner, name, old.to(device=new.device, dtype=torch.float32))
    return module
