"""How shipped weights are stored (engine/drafts/storage.py): int8 matrices with per-row scales, float16 vectors,
loaded into the model's dtype; the shipped drafts fit the size a device call can carry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.drafts.shipped import DRAFTS_DIR, EMBEDDED_DRAFTS
from engine.drafts.storage import MAX_SHARD_BYTES, SCALE, load_weights, save_weights, shards


def test_a_matrix_round_trips_within_half_a_step_of_its_row(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    save_weights({"layer.weight": w, "norm.weight": torch.rand(96, generator=g) + 0.5}, tmp_path)
    stored = load_file(str(tmp_path / "model-00.safetensors"))
    assert stored["layer.weight"].dtype == torch.int8 and stored["layer.weight" + SCALE].shape == (64,)
    assert stored["norm.weight"].dtype == torch.float16
    back = load_weights(tmp_path, torch.float32)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((back["layer.weight"] - w).abs() <= step / 2 + 1e-7 * step).all()
    # each row's largest weight comes back to float32 rounding (127 steps of absmax / 127)
    torch.testing.assert_close(back["layer.weight"].abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6, atol=0)
    assert set(back) == {"layer.weight", "norm.weight"}


def test_an_all_zero_row_stays_zero_and_dtype_follows_the_model(tmp_path):
    w = torch.randn(4, 8)
    w[2] = 0
    save_weights({"w": w}, tmp_path)
    back = load_weights(tmp_path, torch.bfloat16)
    assert back["w"].dtype == torch.bfloat16 and torch.equal(back["w"][2], torch.zeros(8, dtype=torch.bfloat16))
    assert torch.isfinite(back["w"].float()).all()


def test_a_float16_draft_saved_before_loads_as_it_was(tmp_path):
    w = torch.randn(16, 16).to(torch.float16)
    save_file({"w": w}, str(tmp_path / "model-00.safetensors"))
    assert torch.equal(load_weights(tmp_path, torch.float32)["w"], w.float())


def test_shards_keep_a_matrix_with_its_scales(tmp_path):
    big = {f"m{i}.weight": torch.randn(256, 512) for i in range(3)}  # 128 KiB each as int8
    stored = {}
    for name, w in big.items():
        stored[name] = w.to(torch.int8)
        stored[name + SCALE] = torch.ones(256)
    groups = shards(stored, 200 * 1024)
    assert len(groups) == 3
    for group in groups:
        assert all((k + SCALE in group) for k in group if not k.endswith(SCALE))


@pytest.mark.parametrize("name", sorted(EMBEDDED_DRAFTS))
def test_each_shipped_draft_is_stored_compactly(name):
    folder = DRAFTS_DIR / EMBEDDED_DRAFTS[name]
    for file in folder.glob("model*.safetensors"):
        assert file.stat().st_size <= MAX_SHARD_BYTES
        matrices = [t for k, t in load_file(str(file)).items() if not k.endswith(SCALE) and t.ndim == 2]
        assert matrices and all(t.dtype == torch.int8 for t in matrices)


def test_the_shipped_weights_fit_in_32_mib():
    root = Path(DRAFTS_DIR)
    assert root.name == "weights" and not (root.parent / "engine" / "drafts" / "smollm2-135m-draft").exists()
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert total <= 32 * 2**20, f"{total / 2**20:.1f} MiB"
