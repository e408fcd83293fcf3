"""Issue 41, part 3, the models' defects that reading the CUDA path showed, checked on the CPU: rotary tables that stay
float32 whatever a draft's dtype, a prefill whose LM head runs on its last row only, devices compared by their
canonical names, and the static-cache decode paths (lean, static_forward) in a device-agnostic variant whose steps
have static shapes and no host sync (what torch.compile(mode="reduce-overhead") captures as CUDA graphs on a GPU)."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.drafts.distilled import draft_from_target, load_draft_dir, place, save_draft
from engine.drafts.head import FeatureHead, load_head_dir, save_head
from engine.models.devices import cast_model, rotary_buffers
from engine.models.lean import LeanLlama

from .test_lean import tiny_llama


# ---------------------------------------------------------------- 1. rotary tables stay float32
def fp32_inv_freq(config) -> torch.Tensor:
    """The table transformers computes for `config`, in float32."""
    return LlamaRotaryEmbedding(config).inv_freq


def assert_rotary_fp32(module, config) -> None:
    found = rotary_buffers(module)
    assert found, "no rotary table found"
    want = fp32_inv_freq(config)
    for owner, name in found:
        table = getattr(owner, name)
        assert table.dtype == torch.float32, (name, table.dtype)
        assert torch.equal(table, want), name


def test_a_draft_or_head_cast_to_bfloat16_keeps_float32_rotary_tables(tmp_path):
    """A distilled draft (place, load_draft_dir), a feature head (from_target of a bfloat16 target, load_head_dir) and
    any module through cast_model: their weights in bfloat16, their inv_freq float32 with the float32 values (a .to()
    rounded them to bfloat16: 0.0094 became 0.0093994140625 and so on). The lean path's precomputed cos and sin are
    float32 too, equal to the rotary module's own float32 output."""
    target = tiny_llama(seed=1)
    config = target.config
    draft = place(draft_from_target(target, 2), target, "cpu", torch.bfloat16)
    assert next(draft.parameters()).dtype == torch.bfloat16
    assert_rotary_fp32(draft, config)

    save_draft(draft_from_target(target, 2), tmp_path / "draft", None, {})
    loaded, _ = load_draft_dir(tmp_path / "draft", target, torch.bfloat16, torch.device("cpu"))
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert_rotary_fp32(loaded, config)

    bf16_target = cast_model(tiny_llama(seed=1), dtype=torch.bfloat16)
    assert_rotary_fp32(bf16_target, config)
    head = FeatureHead.from_target(bf16_target, 1)
    assert next(head.parameters()).dtype == torch.bfloat16
    assert_rotary_fp32(head, config)
    save_head(FeatureHead.from_target(target, 1), tmp_path / "head", torch.arange(10),
              {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
               "target_layers": config.num_hidden_layers})
    head, _ = load_head_dir(tmp_path / "head", target, torch.bfloat16, "cpu")
    assert next(head.parameters()).dtype == torch.bfloat16
    assert_rotary_fp32(head, config)

    rounded = tiny_llama(seed=1).to(torch.bfloat16)  # cast elsewhere, without the helper: recomputed from the config
    assert_rotary_fp32(cast_model(rounded, dtype=torch.bfloat16), config)

    lean = LeanLlama(draft, "float32")
    cos, sin = lean._rope_table(40)
    rotary = LlamaRotaryEmbedding(config)
    want_cos, want_sin = rotary(torch.zeros(1), torch.arange(cos.shape[0])[None])
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


# ---------------------------------------------------------------- 3. devices compared by their canonical names
def fake_gpus(monkeypatch, count: int = 2, current: int = 0) -> None:
    """torch.cuda as on a machine with `count` GPUs, `current` the current one (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_devices_are_canonical_and_a_draft_on_the_targets_gpu_shares_its_embeddings(monkeypatch):
    """pick_device names the GPU as its tensors (and the workers) do, `cuda:<current>`; and `place`, given `cuda` for
    a target whose tensors report `cuda:0`, shares the target's embeddings and head instead of copying them (the move
    itself is stubbed: no CUDA tensor is made). Another GPU, or another dtype, still gets its own copies."""
    from transformers import LlamaForCausalLM

    from engine.drafts import distilled
    from engine.models.devices import canonical_device, same_device
    from engine.models.loading import pick_device

    fake_gpus(monkeypatch, count=2, current=1)
    assert pick_device("cuda") == torch.device("cuda", 1) == pick_device(None) == canonical_device("cuda")
    assert pick_device("cuda:0") == torch.device("cuda", 0) and pick_device("cpu") == torch.device("cpu")
    assert same_device("cuda", "cuda:1") and same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert not same_device("cuda", "cuda:0") and not same_device("cuda:0", "cpu") and same_device(None, "cpu")

    fake_gpus(monkeypatch, count=1, current=0)
    target, moved = tiny_llama(seed=3), []
    monkeypatch.setattr(LlamaForCausalLM, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(distilled, "cast_model", lambda m, device=None, dtype=None: moved.append((device, dtype)) or m)
    draft = place(draft_from_target(target, 1), target, "cuda", torch.float32)
    assert moved == [("cuda", torch.float32)]
    assert draft.model.embed_tokens is target.model.embed_tokens and draft.lm_head is target.lm_head
    fake_gpus(monkeypatch, count=2, current=0)
    other = place(draft_from_target(target, 1), target, "cuda:1", torch.float32)
    assert other.model.embed_tokens is not target.model.embed_tokens and other.lm_head is not target.lm_head
    half = place(draft_from_target(target, 1), target, "cuda", torch.bfloat16)
    assert half.model.embed_tokens is not target.model.embed_tokens


# ---------------------------------------------------------------- 2. a prefill's LM head on its last row only
class RowCounter:
    """A head that counts the rows it is fed and computes them with the real one."""

    def __init__(self, head):
        self.head, self.rows = head, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.numel() // x.shape[-1])
        return self.head(x)


@pytest.mark.parametrize("path", ["transformers", "static", "lean", "subset", "unplain"])
def test_last_only_runs_the_head_on_one_row(path):
    """LM.forward(last_only=True) on each of its paths: logits [1, 1, V] equal to the last row of a full pass
    (float rounding: one row may go through another kernel than T rows), the head fed 1 row, the features every
    position's; the default still gives every row. `unplain`: a model whose logits are more than its head (a head with
    a bias), through transformers' logits_to_keep, its lm_head counted by a forward hook."""
    from engine.models.loading import LM

    model = tiny_llama(seed=4)
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(4))
    kwargs = {"static": dict(static=True), "lean": dict(lean=True), "subset": dict(head_ids=torch.arange(0, 101, 2))}
    if path == "unplain":
        model.lm_head.bias = torch.nn.Parameter(torch.randn(101) * 0.1)
    lm = LM("tiny", model, None, 101, **kwargs.get(path, {}))
    assert (lm._head is None) == (path == "unplain") and lm.static == (path == "static")
    counted = []
    if path == "unplain":
        model.lm_head.register_forward_hook(lambda m, args, out: counted.append(args[0].shape[1]))
    else:
        lm._head = RowCounter(lm._head)
        counted = lm._head.rows
    full = lm.forward(ids, lm.new_cache(), features=True)
    assert full.logits.shape == (1, 20, 101) and counted == [20]
    last = lm.forward(ids, lm.new_cache(), features=True, last_only=True)
    assert last.logits.shape == (1, 1, 101) and counted == [20, 1]
    torch.testing.assert_close(last.logits, full.logits[:, -1:], rtol=1e-5, atol=1e-5)
    if path != "unplain":
        assert torch.equal(last.features, full.features) and last.features.shape == (1, 20, 96)
    plain = lm.last_row.forward(ids, lm.new_cache())  # the view a prefill goes through
    assert plain.shape == (1, 1, 101) and counted[-1] == 1 and lm.last_row.vocab_size == 101


def test_a_prefill_feeds_the_target_head_one_row(tmp_path):
    """Through the engine (decoding.prefill): the target's head runs on 1 row for a 12-token prompt, then on the rows
    each step feeds; the output is AR's before and after."""
    from engine.config import GenerationConfig
    from engine.engine import Engine
    from engine.models.loading import load_pair

    from .conftest import make_tiny_model

    target = make_tiny_model(tmp_path / "target", seed=1)
    draft = make_tiny_model(tmp_path / "draft", seed=1, perturb=0.5, perturb_seed=2)
    engine = Engine(load_pair(str(target), str(draft), device="cpu", draft_worker="thread"))
    try:
        prompt = [2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5]
        want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=6)).token_ids
        counter = engine.pair.target._head = RowCounter(engine.pair.target._head)
        assert engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=6)).token_ids == want
        assert counter.rows == [1] * 6  # the prefill's row, then five 1-token steps
        counter.rows.clear()
        assert engine.run(prompt, GenerationConfig(method="sd", max_new_tokens=6, gamma=3)).token_ids == want
        assert counter.rows[0] == 1 and all(r <= 4 for r in counter.rows[1:])  # verify passes: gamma + 1 rows
    finally:
        engine.close()
