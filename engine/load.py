"""Loading models from ModelSettings: the one recipe that `python -m engine` (generate, bench, costs, train-hrad)
and the app share."""

from __future__ import annotations

import sys

import torch

from engine.config import ModelSettings, SpecBranchError
from engine.engine import Engine
from engine.models.loading import (
    LM,
    ModelPair,
    draft_matmul_kind,
    load_pair,
    pick_device,
    pick_dtype,
    with_draft,
)


def pair_for(
    models: ModelSettings, draft: str | None, target: LM | None = None, compile_later: bool = False
) -> ModelPair:
    """The target of `models` with the draft spec `draft` (None: no draft): on `target` (an LM already loaded, the
    draft on its device) where given, else loading models.target too. compile_later: see loading.with_draft."""
    if target is not None:
        return with_draft(
            target,
            draft,
            trust_remote_code=models.trust_remote_code,
            draft_matmul=models.draft_matmul,
            draft_forward=models.draft_forward,
            draft_worker=models.draft_worker,
            compile_later=compile_later,
        )
    return load_pair(
        models.target,
        draft,
        device=models.device,
        draft_device=models.draft_device,
        dtype=models.dtype,
        trust_remote_code=models.trust_remote_code,
        draft_matmul=models.draft_matmul,
        draft_forward=models.draft_forward,
        target_forward=models.target_forward,
        draft_worker=models.draft_worker,
        compile_later=compile_later,
    )


def engine_for(models: ModelSettings, pair: ModelPair, measure_target_step: bool = False) -> Engine:
    """An Engine on a loaded pair, with the thread counts of `models`."""
    return Engine(
        pair,
        threads=max(1, models.threads),
        solo_threads=models.solo_threads,
        measure_target_step=measure_target_step,
    )


def check_models(models: ModelSettings, need_draft: bool) -> None:
    """Refuse, before anything loads, settings this machine cannot run: a solo thread count under 1, a device it
    lacks, and (with a draft) a draft matmul its CPU cannot run."""
    if models.solo_threads is not None and models.solo_threads < 1:
        raise SpecBranchError(f"--solo-threads must be at least 1, got {models.solo_threads}")
    for device in (models.device, models.draft_device):
        pick_device(device)
    if need_draft:
        ddev = pick_device(models.draft_device or models.device)
        draft_matmul_kind(models.draft_matmul, ddev, pick_dtype(models.dtype, ddev))


def load_engine(models: ModelSettings, need_draft: bool) -> Engine:
    """The command line's Engine: checked (check_models), loaded with models.draft where `need_draft`, and what
    loading could not do as asked said on stderr."""
    check_models(models, need_draft)
    torch.set_num_threads(max(1, models.threads))
    pair = pair_for(models, models.draft if need_draft else None)
    if pair.draft_worker_why:
        print(f"note: the draft runs in this process: {pair.draft_worker_why}", file=sys.stderr)
    if pair.draft is not None and pair.draft.compile_why:
        print(f"note: the draft's steps run eager, not compiled: {pair.draft.compile_why}", file=sys.stderr)
    return engine_for(models, pair)
