"""The CPU's row-count matmul layouts (engine/lm_head.py): the same product as F.linear for every row count, with
and without the one-row copy, the packed copy and the row cap; the packed path's rows do not depend on how many
rows are fed (so padding 2-3 rows to PACK_ROWS changes nothing); fast_linears routes a model's linear layers
through them without changing what the model computes (beyond float rounding) and without touching its LM head;
a draft's bfloat16 matmuls (Bf16Matmul) never reach the target."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import GenerationConfig, SpecBranchError
from engine.engine import Engine
from engine.lm_head import (LAYER_MAX_ROWS, PACK_ROWS, Bf16Matmul, HeadMatmul, bf16_supported, fast_linears,
                            packed_matmul, packed_weight)
from engine.models import draft_bf16, load_pair


def test_every_row_count_gives_the_linear_product():
    torch.manual_seed(0)
    w = torch.randn(96, 40)
    for max_rows, one_row, packed in ((None, True, True), (LAYER_MAX_ROWS, True, False), (LAYER_MAX_ROWS, False, False),
                                      (None, False, True)):
        mm = HeadMatmul(w, max_rows, one_row, packed)
        assert (mm.wt is not None) == one_row
        assert (mm.packed is not None) == (packed and torch.backends.mkldnn.is_available())
        for rows in (1, 2, 3, 4, 6, 8, 17):
            x = torch.randn(1, rows, 40)
            out = mm(x)
            assert out.shape == (1, rows, 96)
            torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    # a gradient to track goes through F.linear, and flows
    x = torch.randn(2, 40, requires_grad=True)
    HeadMatmul(w, LAYER_MAX_ROWS)(x).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 40))


def test_packed_rows_do_not_depend_on_how_many_are_fed():
    """A verify pass's row t must be what the packed kernel gives row t fed with any other rows: padding 2-3
    rows to PACK_ROWS with zeros, or feeding a longer line, changes no bit of it."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: HeadMatmul uses its other layouts (the test above covers them)")
    torch.manual_seed(1)
    w = torch.randn(200, 64)
    packed = packed_weight(w)
    assert packed is not None
    x = torch.randn(9, 64)
    alone = torch.cat([packed_matmul(x[i:i + 1], packed) for i in range(9)])  # each row padded to PACK_ROWS
    for rows in range(1, 10):
        assert torch.equal(packed_matmul(x[:rows], packed), alone[:rows]), rows
    torch.testing.assert_close(alone, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert packed_matmul(x[:1], packed).shape == (1, 200) and PACK_ROWS > 1  # padding rows are cut off


def test_fast_linears_routes_the_layers_not_the_head(tmp_path):
    from .conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "m", seed=3, layers=2)
    pair = load_pair(str(path), None, device="cpu")  # the LM wrapper routes the target's layers
    model = pair.target.model
    routed = [n for n, m in model.named_modules() if getattr(m, "_fast_layout", False)]
    assert len(routed) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert not any("lm_head" in n for n in routed) and "forward" not in vars(model.lm_head)
    assert fast_linears(model) == 0  # idempotent
    # the routed model computes what the plain one does, for one row and for a verify pass's few
    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
    with torch.inference_mode():
        fast = model(ids).logits
        for _, m in model.named_modules():
            vars(m).pop("forward", None)
        plain = model(ids).logits
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)


def test_engine_greedy_equals_ar_with_routed_layers(tiny_engine):
    """Speculation verifies a few rows at a time (the multi-row layout) while AR decodes one (the one-row
    layout): greedy output stays identical."""
    assert any(getattr(m, "_fast_layout", False) for m in tiny_engine.pair.target.model.modules())
    for prompt in ([2, 3, 4, 5], [8] * 6):
        want = tiny_engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
        for method in ("sd", "pearl", "specbranch"):
            r = tiny_engine.run(prompt, GenerationConfig(method=method, max_new_tokens=40, gamma=3, epsilon=0.7))
            assert r.token_ids == want, method


needs_bf16 = pytest.mark.skipif(not bf16_supported(), reason="this CPU runs no bfloat16 matmul natively")


@needs_bf16
def test_bf16_matmul_is_the_product_to_bfloat16_rounding():
    torch.manual_seed(2)
    w = torch.randn(96, 40)
    mm = Bf16Matmul(w)
    for rows in (1, 3, 8):
        x = torch.randn(1, rows, 40)
        out = mm(x)
        assert out.dtype == torch.float32 and out.shape == (1, rows, 96)
        want = F.linear(x.bfloat16().double(), w.bfloat16().double()).float()  # both operands rounded, exact sum
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
        assert not torch.equal(out, F.linear(x, w))  # it is the cheaper, lossy product: a draft's only
    x = torch.randn(2, 40, requires_grad=True)  # a gradient to track goes through float32 F.linear
    mm(x).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 40))


def test_draft_matmul_choice_is_checked_and_auto_follows_the_cpu():
    cpu = torch.device("cpu")
    assert draft_bf16("float32", cpu, torch.float32) is False
    assert draft_bf16("auto", cpu, torch.float32) is bf16_supported()
    assert draft_bf16("auto", cpu, torch.bfloat16) is False  # a draft already in a low dtype is left alone
    assert draft_bf16("auto", torch.device("cuda"), torch.float32) is False  # GPUs: --dtype is the knob
    with pytest.raises(SpecBranchError, match="unknown draft matmul"):
        draft_bf16("int8", cpu, torch.float32)
    with pytest.raises(SpecBranchError, match="natively"):
        draft_bf16("bfloat16", torch.device("cuda"), torch.float32)


@needs_bf16
def test_bf16_draft_leaves_the_target_exact(tiny_dirs):
    """A bfloat16 draft streams half the bytes; the target, even when it is its own draft ("self"), keeps its
    float32 layouts, and greedy output stays the target's."""
    pair = load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="bfloat16")
    kinds = lambda m: {type(vars(x).get("forward")).__name__ for x in m.modules() if getattr(x, "_fast_layout", 0)}
    assert kinds(pair.draft.model) == {"Bf16Matmul"} and isinstance(pair.draft._head, Bf16Matmul)
    assert kinds(pair.target.model) == {"HeadMatmul"}
    own = load_pair(str(tiny_dirs["target"]), "self", device="cpu", draft_matmul="bfloat16")
    assert kinds(own.target.model) == {"HeadMatmul"} and own.draft.model is own.target.model
    engine = Engine(pair)
    try:
        prompt = [2, 3, 4, 5]
        want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
        for method in ("sd", "pearl", "specbranch"):
            assert engine.run(prompt, GenerationConfig(method=method, max_new_tokens=40, gamma=3)).token_ids == want
    finally:
        engine.close()
