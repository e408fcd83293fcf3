"""The lean decode path for a Llama draft (engine/models/lean.py): the same hidden states as transformers' forward
through prefill, single steps, rollback, forks and a cache that outgrows its buffers; refusals where it does not fit."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import GenerationConfig, SpecBranchError
from engine.drafts.process import close_distributions
from engine.engine import Engine
from engine.events import Notice
from engine.kernels.lm_head import bf16_supported, fast_linears, int4_supported
from engine.measure.bench import draft_forward_kind
from engine.models.lean import KVBuffer, LeanLlama, fits
from engine.models.loading import LM, draft_matmul_kind, lean_draft

from .conftest import bfloat16_refused_here


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """Grouped-query attention (3 query heads per KV head) and rotary scaling, so both code paths are exercised."""
    torch.manual_seed(seed)
    config = dict(
        vocab_size=101,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    )
    config.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def reference(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' final-norm hidden states for the whole sequence in one pass, [B, T, H]."""
    with torch.inference_mode():
        return model.model(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("kernels", ["cpu", "generic"])
def test_lean_decoder_equals_transformers_through_steps_rollback_and_forks(kernels):
    """kernels: the CPU's, or the generic ones a GPU runs (lean.GenericDecoder, static shapes), forced here."""
    model = tiny_llama()
    lean = LeanLlama(model, "float32", kernels=kernels)
    assert lean.kernels == kernels and (lean._generic is not None) == (kernels == "generic")
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(1))
    want = reference(model, ids)
    cache = lean.new_cache(capacity=8)  # grows (doubling) as it is fed: 8 -> 16 -> 32 -> 64
    got = torch.cat([lean(ids[:, :13], cache), lean(ids[:, 13:14], cache), lean(ids[:, 14:30], cache)], 1)
    torch.testing.assert_close(got, want[:, :30], rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 30 and cache.capacity >= 30
    cache.crop(-6)  # roll back by moving the pointer; the stale rows are overwritten by what is fed next
    assert cache.get_seq_length() == 24
    torch.testing.assert_close(lean(ids[:, 24:31], cache), want[:, 24:31], rtol=1e-5, atol=1e-5)
    # fork into 3 rows that take different next tokens: each row is the model's pass over its own sequence
    cache.batch_repeat_interleave(3)
    nxt = torch.tensor([[5], [6], [7]])
    forked = lean(nxt, cache)
    for row in range(3):
        seq = torch.cat([ids[:, :31], nxt[row : row + 1]], 1)
        torch.testing.assert_close(forked[row, -1], reference(model, seq)[0, -1], rtol=1e-5, atol=1e-5)
    cache.batch_select_indices(torch.tensor([1]))  # keep the second branch, then go on from it
    seq = torch.cat([ids[:, :31], nxt[1:2], ids[:, 31:34]], 1)
    torch.testing.assert_close(lean(ids[:, 31:34], cache), reference(model, seq)[:, -3:], rtol=1e-5, atol=1e-5)
    assert cache.rows == 1 and cache.get_seq_length() == 35
    # fork again from that one-row view, keep two rows in swapped order, then the last one: only the positions
    # held are copied (the buffers past them start empty), and it must not show
    cache.batch_repeat_interleave(2)
    lean(torch.tensor([[8], [9]]), cache)
    cache.batch_select_indices(torch.tensor([1, 0]))
    seqs = [torch.cat([seq, torch.tensor([[t]]), ids[:, 34:40]], 1) for t in (9, 8)]
    got = lean(ids[:, 34:40].repeat(2, 1), cache)  # 36 -> 42 positions: past the 32 held when it forked
    for row, s in enumerate(seqs):
        torch.testing.assert_close(got[row], reference(model, s)[0, -6:], rtol=1e-5, atol=1e-5)
    cache.batch_select_indices(torch.tensor([-1]))
    torch.testing.assert_close(
        lean(ids[:, 2:3], cache)[0, -1],
        reference(model, torch.cat([seqs[1], ids[:, 2:3]], 1))[0, -1],
        rtol=1e-5,
        atol=1e-5,
    )
    cache.crop(10)  # a non-negative crop keeps the first n, as transformers' caches do
    assert cache.get_seq_length() == 10
    with pytest.raises(ValueError, match="holds 1 rows, fed 2"):
        lean(ids[:, :2].reshape(2, 1), cache)


@pytest.mark.parametrize("kernels", ["cpu", "generic"])
def test_branches_share_the_positions_held_when_they_forked(kernels):
    """BranchKV: a fork copies nothing, and each branch still gets its own sequence's states through multi-token
    feeds, a step rolled back within the branches, a fork of the branches, and a rollback to before the fork; through
    the CPU's kernels and the generic ones (whose k-row step attends over the whole buffer, by the same tree mask)."""
    model = tiny_llama(seed=2)
    lean = LeanLlama(model, "float32", kernels=kernels)
    ids = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(3))
    cache = lean.new_cache(capacity=16)
    lean(ids[:, :20], cache)
    keys = cache.keys[0]
    cache.batch_repeat_interleave(3)
    assert cache.rows == 3 and cache.keys[0] is keys and keys.shape[0] == 1  # nothing copied: one physical row
    seqs = [ids[0, :20].tolist() for _ in range(3)]

    def feed(tokens):  # tokens: one list a branch; checks every branch's new states against its own sequence
        got = lean(torch.tensor(tokens), cache)
        for row, new in enumerate(tokens):
            seqs[row] = seqs[row] + new
            want = reference(model, torch.tensor([seqs[row]]))[0, -len(new) :]
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
        assert cache.get_seq_length() == len(seqs[0])

    feed([[5, 6], [7, 8], [9, 10]])  # two tokens a branch in one pass
    feed([[11], [12], [13]])
    cache.crop(-1)  # a branch step held back: every branch drops its last token
    seqs[:] = [s[:-1] for s in seqs]
    feed([[14], [15], [16]])
    cache.batch_repeat_interleave(2)  # the branches fork again: six, each continuing its parent
    seqs[:] = [s for s in seqs for _ in range(2)]
    feed([[20 + r] for r in range(6)])
    cache.batch_select_indices(torch.tensor([4, 1]))  # keep two, in this order
    seqs[:] = [seqs[4], seqs[1]]
    feed([[40], [41]])
    cache.crop(18)  # back before the fork: both branches hold the same 18 positions again
    seqs[:] = [s[:18] for s in seqs]
    assert cache.rows == 2
    feed([[50, 51], [52, 53]])
    cache.batch_select_indices(torch.tensor([1]))  # resolved: the survivor's tokens move behind the shared ones
    seqs[:] = [seqs[1]]
    assert cache.rows == 1 and cache.length == cache.get_seq_length() == 20
    feed([ids[0, 20:30].tolist()])  # and it grows past its buffers as one row
    assert cache.capacity >= 30


def test_lean_logits_match_the_routed_transformers_forward():
    """Through LM (the head, the shared vocabulary) the lean path gives the logits the same draft gives through
    transformers' forward with its linears routed the same way (fast_linears)."""
    model = tiny_llama(seed=2)
    fast_linears(model, "float32")
    routed = LM("tiny", model, None, 101)
    lean = LM("tiny", model, None, 101, lean=True)
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(3))
    a, b = routed.new_cache(), lean.new_cache()
    assert isinstance(b, KVBuffer) and not isinstance(a, KVBuffer)
    for part in (ids[:, :12], ids[:, 12:13], ids[:, 13:20]):
        torch.testing.assert_close(lean.forward(part, b), routed.forward(part, a), rtol=1e-4, atol=1e-4)
    out = lean.forward(ids[:, :1], b, features=True)  # features come from the lean pass too
    assert out.features.shape == (1, 1, 96)
    with pytest.raises(ValueError, match="per-layer hidden states"):
        lean.forward(ids[:, :1], b, hidden_states=True)


@pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 kernel")
def test_lean_int4_fuses_without_changing_the_codes():
    """q, k and v stacked into one 4-bit weight (and gate with up) quantize to the same groups as apart, since a
    group runs along a row: the fused pass equals the per-layer 4-bit pass up to bfloat16 rounding of the input."""
    model = tiny_llama(seed=4)
    twin = tiny_llama(seed=4)
    fast_linears(twin, "int4")
    ids = torch.randint(0, 101, (1, 24), generator=torch.Generator().manual_seed(5))
    lean = LeanLlama(model, "int4")
    got = lean(ids, lean.new_cache())
    torch.testing.assert_close(got, reference(twin, ids), rtol=2e-2, atol=2e-2)
    assert (got - reference(model, ids)).abs().max() > 1e-4  # and it is the 4-bit product, not float32's


def test_lean_refuses_what_it_does_not_fit():
    assert fits(tiny_llama()) is None
    assert "attention_bias" in fits(tiny_llama(attention_bias=True))
    assert "hidden_act gelu" in fits(tiny_llama(hidden_act="gelu"))
    assert "rope_type dynamic" in fits(
        tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5000.0})
    )
    with pytest.raises(ValueError, match="does not fit this model: attention_bias"):
        LeanLlama(tiny_llama(attention_bias=True))
    draft, target = tiny_llama(seed=6), tiny_llama(seed=7)
    assert lean_draft(draft, target, "lean") and not lean_draft(draft, target, "transformers")
    assert not lean_draft(target, target, "lean")  # the float32 target as its own draft keeps its own forward
    assert not lean_draft(tiny_llama(mlp_bias=True), target, "lean")
    with pytest.raises(SpecBranchError, match="unknown draft forward 'fast'"):
        lean_draft(draft, target, "fast")


@pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 kernel")
def test_compiled_steps_follow_the_eager_ones_and_decode_exactly(tiny_dirs):
    """--draft-forward lean-compiled: a one-token step on one branch of a 4-bit draft runs through torch.compile,
    compiled when the draft loads (this machine has the C++ compiler inductor needs, so it must compile: compile_why
    is empty; a bfloat16 draft says why it stays eager, without trying). Its states equal the eager step's to float
    rounding through steps (on one thread or two, never compiled again), a rollback, a cache that outgrows its buffers
    and a fork (whose k-row steps stay eager); greedy SD, PEARL and SpecBranch still give the target's output."""
    from engine.models.loading import load_pair

    from .test_lm_head import assert_speculation_equals_ar

    if bf16_supported():  # a bfloat16 draft is refused at once; a CPU without bfloat16 has no such draft at all
        assert "do not compile" in LeanLlama(tiny_llama(), "bfloat16", compiled=True).compile_why
    else:
        with pytest.raises(SpecBranchError, match="runs bfloat16 natively"):
            draft_matmul_kind("bfloat16", torch.device("cpu"), torch.float32)
    pair = load_pair(
        str(tiny_dirs["target"]),
        str(tiny_dirs["draft"]),
        device="cpu",
        draft_matmul="int4",
        draft_forward="lean-compiled",
    )
    draft = pair.draft
    assert draft.lean and draft.compiled and draft.compile_why == "" and draft._lean._step is not None
    assert [draft_forward_kind(draft, m) for m in ("ar", "pearl", "hf-assisted")] == [
        None,
        "lean-compiled",
        "transformers",
    ]  # what a bench records
    compiled, eager = draft._lean, LeanLlama(draft.model, draft.matmul)
    ids = torch.randint(0, 10, (1, 30), generator=torch.Generator().manual_seed(3))
    caches = {lean: lean.new_cache(capacity=8) for lean in (compiled, eager)}  # 8 -> 16 -> 32: grows mid-steps
    for lean, cache in caches.items():
        lean(ids[:, :4], cache)
    # no compile mid-run: each of these failed a guard of the compiled graph before (docs/models.md): ids made
    # outside inference mode, buffers of another length than the warm-up's, a step asked for on two threads
    threads, no_recompile = torch.get_num_threads(), torch._dynamo.config.patch(error_on_recompile=True)
    try:
        with no_recompile:
            for i in range(4, 20):
                torch.set_num_threads(1 + i % 2)
                got, want = (lean(ids[:, i : i + 1], cache) for lean, cache in caches.items())
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                if i == 12:  # roll back 3 and feed them again
                    for cache in caches.values():
                        cache.crop(-3)
                    for lean, cache in caches.items():
                        lean(ids[:, 10:13], cache)
    finally:
        torch.set_num_threads(threads)
    assert caches[compiled].capacity >= 20 and caches[compiled].get_seq_length() == 20
    for lean, cache in caches.items():  # a fork's 2-row step (eager on both), then one branch on its own again
        cache.batch_repeat_interleave(2)
        lean(torch.tensor([[3], [4]]), cache)
        cache.batch_select_indices(torch.tensor([1]))
    got, want = (lean(ids[:, 21:22], cache) for lean, cache in caches.items())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_speculation_equals_ar(pair)


@pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 kernel")
def test_a_draft_in_its_process_compiles_in_another_and_decodes_exactly_meanwhile(tiny_dirs):
    """The app's way (compile_later): the draft loads eager, in its own process. Asked to compile, a new process loads
    it and compiles its step while the first one serves; the first run to start once it is ready takes it, and the
    first process ends. A run before then says that it drafts with the eager step; greedy SD, PEARL and SpecBranch
    give the target's output before, while and after; once compiled, no notice. In this process the draft compiles
    when asked, at once."""
    from engine.models.loading import load_pair

    pair = load_pair(
        str(tiny_dirs["target"]),
        str(tiny_dirs["draft"]),
        device="cpu",
        draft_matmul="int4",
        draft_forward="lean-compiled",
        draft_worker="process",
        compile_later=True,
    )
    engine, prompt, messages = Engine(pair), [2, 3, 4, 5], []

    def compile_notices() -> list[str]:
        """Notices of runs of each method, each checked against AR's tokens."""
        want, out = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids, []
        for method in ("sd", "pearl", "specbranch"):
            result = engine.run(prompt, GenerationConfig(method=method, max_new_tokens=40, gamma=3))
            assert result.token_ids == want, method
            out += [e.message for e in result.events if isinstance(e, Notice) and "compiling" in e.message]
        return out

    try:
        first = pair.draft
        assert pair.draft_worker == "process", pair.draft_worker_why
        assert first.compile_status() == ("waiting", "") and first.local.compile_status()[0] == "waiting"
        assert draft_forward_kind(first, "sd") == "lean"  # until it has landed, the steps run eager
        assert len(compile_notices()) == 3
        first.start_compile(messages.append)
        assert first.compile_status()[0] in ("compiling", "compiled")
        compile_notices()  # while it compiles, most likely
        first._twin_thread.join()  # however long compiling takes on a busy machine (pytest-timeout ends a hang)
        assert first.compile_status() == ("compiled", ""), messages
        assert compile_notices() == [] and engine.pair.draft is not first and first._process.poll() is not None
        assert engine.pair.draft.compile_status() == ("compiled", "") and "compiled in a process" in messages[0]
        assert draft_forward_kind(engine.pair.draft, "sd") == "lean-compiled"
        assert first.local.compile_status()[0] == "waiting"  # this process never compiled it
        ids = torch.tensor([prompt])  # the twin's probe: the same model within rounding, another model refused
        mine, other = (lm.forward(ids, lm.new_cache())[:, -1] for lm in (first.local, pair.target))
        assert close_distributions(mine, mine + 0.01 * torch.randn_like(mine))
        assert not close_distributions(mine, other), (mine.softmax(-1) - other.softmax(-1)).abs().sum() / 2
        local = load_pair(
            str(tiny_dirs["target"]),
            str(tiny_dirs["draft"]),
            device="cpu",
            draft_matmul="int4",
            draft_forward="lean-compiled",
            compile_later=True,
        ).draft
        assert local.compile_status() == ("waiting", "")
        local.start_compile(messages.append)
        assert local.compile_status() == ("compiled", "") and "one-token steps compiled" in messages[1]
    finally:
        engine.close()


def test_a_bfloat16_draft_in_its_process_is_refused_at_once_without_a_second_process(tiny_dirs):
    """inductor cannot lower a bfloat16 draft's packed matmuls: asked to compile later, the draft says so at once and
    starts no second process; its runs carry no notice (nothing is on its way) and give the target's output."""
    from engine.models.loading import load_pair

    load = dict(
        target=str(tiny_dirs["target"]),
        draft=str(tiny_dirs["draft"]),
        draft_forward="lean-compiled",
        draft_worker="process",
        compile_later=True,
    )
    if bfloat16_refused_here(**load):  # nothing to start on a CPU without native bfloat16
        return
    pair = load_pair(**load, device="cpu", draft_matmul="bfloat16")
    engine, messages = Engine(pair), []
    try:
        assert pair.draft_worker == "process", pair.draft_worker_why
        pair.draft.start_compile(messages.append)
        state, why = pair.draft.compile_status()
        assert state == "eager" and "do not compile" in why and pair.draft._twin_thread is None
        assert "stay eager" in messages[0]
        want = engine.run([2, 3, 4, 5], GenerationConfig(method="ar", max_new_tokens=24)).token_ids
        result = engine.run([2, 3, 4, 5], GenerationConfig(method="specbranch", max_new_tokens=24, gamma=3))
        assert result.token_ids == want
        assert not [e for e in result.events if isinstance(e, Notice) and "compiling" in e.message]
    finally:
        engine.close()
