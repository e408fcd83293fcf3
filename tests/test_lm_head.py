"""The CPU's row-count matmul layouts (engine/kernels/lm_head.py): the same product as F.linear for every row count,
with and without the one-row copy, the packed copy and the row cap; the packed path's rows do not depend on how many
rows are fed (so padding 2-3 rows to PACK_ROWS changes nothing); fast_linears routes a model's linear layers
through them without changing what the model computes (beyond float rounding) and without touching its LM head;
a draft's bfloat16 and 4-bit matmuls (Bf16Matmul, Int4Matmul, and the 4-bit head's float32 shortlist,
ShortlistHead) never reach the target, even when the target is its own draft."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from engine.config import GenerationConfig, SpecBranchError
from engine.engine import Engine
from engine.kernels.lm_head import (
    INT4_GROUP,
    LAYER_MAX_ROWS,
    PACK_ROWS,
    SHORTLIST,
    Bf16Matmul,
    HeadMatmul,
    Int4Matmul,
    ShortlistHead,
    bf16_supported,
    fast_linears,
    int4_fits,
    int4_supported,
    packed_matmul,
    packed_weight,
)
from engine.models.loading import draft_matmul_kind, load_pair

from .conftest import bfloat16_refused_here


def test_every_row_count_gives_the_linear_product():
    torch.manual_seed(0)
    w = torch.randn(96, 40)
    for max_rows, one_row, packed in (
        (None, True, True),
        (LAYER_MAX_ROWS, True, False),
        (LAYER_MAX_ROWS, False, False),
        (None, False, True),
    ):
        mm = HeadMatmul(w, max_rows, one_row, packed, panels=False)  # the library layouts (test_panel: the panels)
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
    alone = torch.cat([packed_matmul(x[i : i + 1], packed) for i in range(9)])  # each row padded to PACK_ROWS
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


def test_the_references_run_transformers_own_layers(tiny_dirs, tiny_reference_model, tiny_engine):
    """The greedy and sampled references (tests/reference.py) come from a model loaded apart, whose Linear layers run
    torch.nn.Linear.forward; the engine's copy of the same weights runs its kernels, and `untouched` says so."""
    from .reference import transformers_model, untouched

    assert untouched(tiny_reference_model) is not tiny_engine.pair.target.model
    with pytest.raises(AssertionError, match="the reference runs the engine's kernels"):
        untouched(tiny_engine.pair.target.model)
    model = transformers_model(tiny_dirs["target"])
    load_pair(str(tiny_dirs["target"]), None, device="cpu")  # loads (and routes) a model of its own
    untouched(model)
    fast_linears(model)
    with pytest.raises(AssertionError, match="q_proj"):
        untouched(model)


def test_engine_greedy_equals_ar_with_routed_layers(tiny_engine, tiny_reference):
    """Speculation verifies a few rows at a time (the multi-row layout) while AR decodes one (the one-row
    layout): greedy output stays identical, and is transformers' own greedy generate() on a model without the routed
    layers (conftest.tiny_reference)."""
    assert any(getattr(m, "_fast_layout", False) for m in tiny_engine.pair.target.model.modules())
    for prompt in ([2, 3, 4, 5], [8] * 6):
        want = tiny_engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
        assert want == tiny_reference(prompt, 40)
        for method in ("sd", "pearl", "specbranch"):
            r = tiny_engine.run(prompt, GenerationConfig(method=method, max_new_tokens=40, gamma=3, epsilon=0.7))
            assert r.token_ids == want, method


def test_bf16_matmul_is_the_product_to_bfloat16_rounding():
    """Where the CPU runs bfloat16 natively; elsewhere no Bf16Matmul is ever built: the choice is refused."""
    if not bf16_supported():
        with pytest.raises(SpecBranchError, match="runs bfloat16 natively"):
            draft_matmul_kind("bfloat16", torch.device("cpu"), torch.float32)
        return
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
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert draft_matmul_kind("float32", cpu, torch.float32) == "float32"
    assert draft_matmul_kind("auto", cpu, torch.float32) == (  # any draft: the cheapest kernel this CPU runs
        "int4" if int4_supported() else "bfloat16" if bf16_supported() else "float32"
    )
    assert draft_matmul_kind("auto", cpu, torch.bfloat16) == "float32"  # a draft already in a low dtype is left alone
    assert draft_matmul_kind("auto", cuda, torch.float32) == "float32"  # GPUs: --dtype is the knob
    with pytest.raises(SpecBranchError, match="unknown draft matmul"):
        draft_matmul_kind("int8", cpu, torch.float32)
    with pytest.raises(SpecBranchError, match="natively"):
        draft_matmul_kind("bfloat16", cuda, torch.float32)
    with pytest.raises(SpecBranchError, match="int4 needs a float32 draft on the CPU"):
        draft_matmul_kind("int4", cuda, torch.float32)
    with pytest.raises(SpecBranchError, match="int4 needs a float32 draft on the CPU"):
        draft_matmul_kind("int4", cpu, torch.bfloat16)


needs_int4 = pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 kernel")


def test_int4_probe_checks_the_kernels_are_there_and_never_calls_them(monkeypatch):
    """int4_supported() reads whether both aten ops are registered with a CPU kernel, and nothing else: a kernel that
    raises makes the int4 tests fail, it does not skip them; only a torch without the ops (or their CPU kernels) skips.
    """

    def broken(*args, **kwargs):
        raise RuntimeError("the int4 kernel is broken")

    have = int4_supported()
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", broken)
    assert int4_supported() is have  # not probed by a call
    if have:
        with pytest.raises(RuntimeError, match="the int4 kernel is broken"):
            Int4Matmul(torch.ones(16, INT4_GROUP))(torch.ones(1, INT4_GROUP))
    registered = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(
        torch._C,
        "_dispatch_has_kernel_for_dispatch_key",
        lambda op, key: op != "aten::_weight_int4pack_mm_for_cpu" and registered(op, key),
    )
    assert not int4_supported()  # registered, but with no CPU kernel: a machine that truly lacks it


@needs_int4
def test_int4_matmul_keeps_4bit_groups_and_rounds_others():
    """Weights that are 4-bit groups already (a scale and a minimum per INT4_GROUP, as in a GGUF's Q4_1 blocks) keep
    their codes, so the product differs from float32's by bfloat16 rounding only (of the input, the scales and zero
    points, and the output); other weights are min-max rounded per group, within half a step."""
    torch.manual_seed(3)
    n, k = 48, 2 * INT4_GROUP
    q = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP))
    q[..., 0], q[..., 1] = 0, 15  # each group spans its whole range, as a Q4_1 block built from its min and max does
    scale, low = torch.rand(n, k // INT4_GROUP, 1) * 0.1 + 0.01, torch.randn(n, k // INT4_GROUP, 1) * 0.1
    w4 = (q * scale + low).reshape(n, k)
    x = torch.randn(2, 3, k)
    want = F.linear(x.bfloat16().double(), w4.double()).float()  # the input rounded, the weights as they are
    torch.testing.assert_close(Int4Matmul(w4)(x), want, rtol=2e-2, atol=2e-2)
    w = torch.randn(n, k)
    err = (Int4Matmul(w)(torch.eye(k)) - w.t()).abs()  # row j of the output: the j-th input column as stored
    step = (w.reshape(n, -1, INT4_GROUP).amax(-1) - w.reshape(n, -1, INT4_GROUP).amin(-1)) / 15
    assert (err.t().reshape(n, -1, INT4_GROUP) <= step[..., None] * 0.5 + 2e-2).all()
    assert err.max() > 1e-3  # it is the cheaper, lossy product: a draft's only
    assert int4_fits(w) and not int4_fits(torch.zeros(40, k)) and not int4_fits(torch.zeros(48, 40))
    x = torch.randn(2, k, requires_grad=True)  # a gradient to track goes through float32 F.linear
    Int4Matmul(w)(x).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, k))


@needs_int4
def test_shortlist_head_is_float32_where_it_counts():
    """The 4-bit head's SHORTLIST largest logits of each row are float32's product, so its argmax is float32's; the
    rest keep the 4-bit rounding (a lossy head: a draft's only). A vocabulary no larger than the shortlist is float32
    throughout, and a gradient to track goes through float32 F.linear."""
    torch.manual_seed(4)
    v, h = 32 * SHORTLIST, 2 * INT4_GROUP
    w = torch.randn(v, h)
    x = torch.randn(2, 3, h) * 3  # [B, T, H]: peaked rows, as a trained model's are
    out, want = ShortlistHead(w)(x), F.linear(x.double(), w.double())
    assert out.shape == (2, 3, v) and out.dtype == torch.float32
    top = want.topk(SHORTLIST // 2, -1).indices  # float32's largest logits: within the 4-bit top SHORTLIST
    torch.testing.assert_close(out.gather(-1, top).double(), want.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.argmax(-1), want.argmax(-1))
    assert (out.double() - want).abs().max() > 1e-3  # outside the shortlist: 4-bit products
    small = w[:16]
    torch.testing.assert_close(
        ShortlistHead(small)(x).double(), F.linear(x.double(), small.double()), rtol=1e-5, atol=1e-5
    )
    x = torch.randn(2, h, requires_grad=True)
    ShortlistHead(w)(x).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, h), rtol=1e-4, atol=1e-3)  # a sum over 2k rows


@needs_int4
def test_shortlist_head_draft_equals_ar(tmp_path):
    """A 4-bit self-draft whose vocabulary the 4-bit kernel fits (32 ids) drafts through ShortlistHead; greedy SD,
    PEARL and SpecBranch still give the target's output (a vocabulary of 10, as in tiny_dirs, keeps HeadMatmul)."""
    from .conftest import make_tiny_model

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)]
    path = make_tiny_model(tmp_path / "m", seed=6, vocab=len(words), words=words)
    pair = load_pair(str(path), "self", device="cpu", draft_matmul="int4")
    assert type(pair.draft._head) is ShortlistHead and type(pair.target._head) is HeadMatmul
    assert_speculation_equals_ar(pair)


def assert_speculation_equals_ar(pair) -> None:
    """Greedy SD, PEARL and SpecBranch on this pair give AR's 40 tokens."""
    engine = Engine(pair)
    try:
        prompt = [2, 3, 4, 5]
        want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
        for method in ("sd", "pearl", "specbranch"):
            assert engine.run(prompt, GenerationConfig(method=method, max_new_tokens=40, gamma=3)).token_ids == want
    finally:
        engine.close()


@pytest.mark.parametrize(
    "matmul, layer, head",
    [
        ("bfloat16", "Bf16Matmul", Bf16Matmul),  # or its refusal, on a CPU without native bfloat16
        # int4's head is a ShortlistHead where the kernel fits the vocabulary; the tiny one of 10 ids keeps float32
        pytest.param("int4", "Int4Matmul", HeadMatmul, marks=needs_int4),
    ],
)
@pytest.mark.parametrize("draft", ["draft", "self"])
@pytest.mark.parametrize("forward", ["lean", "transformers"])
def test_low_precision_draft_leaves_the_target_exact(tiny_dirs, matmul, layer, head, draft, forward):
    """A bfloat16 or 4-bit draft streams fewer bytes; the target keeps its float32 layouts, also when it is its own
    draft: the draft is then a twin, modules of its own over the target's weight tensors (no copy), and greedy output
    stays the target's, through either forward of the draft (engine/models/lean.py or transformers')."""
    load = dict(
        target=str(tiny_dirs["target"]),
        draft="self" if draft == "self" else str(tiny_dirs[draft]),
        draft_forward=forward,
    )
    if matmul == "bfloat16" and bfloat16_refused_here(**load):
        return
    pair = load_pair(**load, device="cpu", draft_matmul=matmul)
    kinds = lambda m: {type(vars(x).get("forward")).__name__ for x in m.modules() if getattr(x, "_fast_layout", 0)}
    assert kinds(pair.draft.model) == {layer} and type(pair.draft._head) is head and pair.draft.matmul == matmul
    assert pair.draft.lean == (forward == "lean") and not pair.target.lean
    assert kinds(pair.target.model) == {"HeadMatmul"}
    if draft == "self":
        assert pair.draft.model is not pair.target.model
        assert {p.data_ptr() for p in pair.draft.model.parameters()} == {
            p.data_ptr() for p in pair.target.model.parameters()
        }
    assert_speculation_equals_ar(pair)


@pytest.mark.parametrize("forward", ["lean", "transformers"])
def test_layer_skipping_self_draft_is_the_target_without_those_layers(tmp_path, forward):
    """`self-skip:2,1` (any order): a twin over the target's own tensors (no copy) that runs its layers 0 and 3 only,
    with its
    final norm and head; its logits are those of the target with the two layers deleted, and greedy output stays
    the target's. auto reads its weights as it would `self`'s."""
    from tests.conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "four", seed=4, layers=4)
    pair = load_pair(str(path), "self-skip:2,1", device="cpu", draft_matmul="float32", draft_forward=forward)
    target, draft = pair.target.model, pair.draft.model
    assert draft.config.num_hidden_layers == 2 and pair.draft.lean == (forward == "lean")
    for mine, theirs in zip(draft.model.layers, [target.model.layers[0], target.model.layers[3]]):
        assert mine.self_attn.q_proj.weight.data_ptr() == theirs.self_attn.q_proj.weight.data_ptr()
    reference = LlamaForCausalLM.from_pretrained(path).eval()
    reference.model.layers = torch.nn.ModuleList([reference.model.layers[0], reference.model.layers[3]])
    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
    with torch.inference_mode():
        want = reference(input_ids=ids, use_cache=False).logits[0]
    got = pair.draft.forward(ids, pair.draft.new_cache())[0]
    torch.testing.assert_close(got, want[:, : got.shape[-1]], rtol=1e-5, atol=1e-5)
    assert_speculation_equals_ar(pair)
    assert (
        draft_matmul_kind("auto", torch.device("cpu"), torch.float32)
        == load_pair(str(path), "self-skip:1", device="cpu").draft.matmul
    )


@pytest.mark.parametrize(
    "spec, why",
    [
        ("self-skip:", "name 1 to 3"),
        ("self-skip:a", "needs layer indices"),
        ("self-skip:4", "name 1 to 3"),
        ("self-skip:0,1,2,3", "name 1 to 3"),
        ("self-skip:-1", "name 1 to 3"),
    ],
)
def test_layer_skipping_self_draft_refuses_layers_the_target_has_not(tmp_path, spec, why):
    from tests.conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "four", seed=4, layers=4)
    with pytest.raises(SpecBranchError, match=why):
        load_pair(str(path), spec, device="cpu")
