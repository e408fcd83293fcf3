"""SpecBranch's target verifies the path and the fork's branches in one pass, as a token tree (engine/methods/
verdict.py, speculation.Feed): a rescued branch's tokens are judged by their own rows in the same pass.

1. The rule stays exact, sampled: exact enumeration in float64 (tests/exact_draws.py) of every candidate pair, branch
   token and verification draw through the engine's own `resolve`, with the target's rows as a function of the
   prefix: the emitted tokens, completed by the target itself, are distributed exactly as the target's own three
   tokens. Negative controls (a branch judged by another branch's rows; by the fork's row instead of its own q) are
   far off at the same enumeration.
2. It pays: on a scripted pair (real transformers Llamas whose weights make each a bigram table) where the draft's
   second choice is the target's token at known positions, SpecBranch reaches the target's own greedy output in
   fewer target passes than PEARL, and its rescued branches are judged in the pass that rescued them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.config import GenerationConfig
from engine.events import TimingSpan, Verified
from engine.methods import verdict as verdicts
from engine.methods.decoding import RunState
from engine.methods.sampling import NO_REPLACEMENT
from engine.methods.speculation import Branch, Drafted, Feed, Fork, Speculation
from engine.methods.verdict import resolve

from .conftest import schedule_draft, tiny_tokenizer
from .exact_draws import outcomes

V = 10  # the tiny tokenizer's vocabulary; the rows below put mass on a few tokens only
SUPPORT = [2, 3, 4]  # where the draft's and the target's rows have mass (the enumeration stays small)
LAST = 5  # the committed token the fork hangs off


def dist(seed: int, support=SUPPORT) -> torch.Tensor:
    """A float32 distribution over V with mass on `support` only (as the engine's float32 rows)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((V,), float("-inf"))
    logits[support] = torch.randn(len(support), generator=g) * 1.5
    return logits.softmax(-1)


def target_row(prefix: tuple[int, ...]) -> torch.Tensor:
    """The target's distribution after `prefix` (tokens after LAST): a fixed function of it."""
    return dist(1000 + hash(prefix) % 100_000)


def exact_outputs(state, q0, q1, judge=None) -> torch.Tensor:
    """P(first three tokens) [V, V, V] of: the fork's 2 candidates drawn without replacement from q0, each branch's
    token drawn from q1[candidate], the pass over [LAST, c1, b1, c2, b2] verified by `resolve` (every draw
    enumerated), and the emitted tokens completed to three by the target's own rows."""
    out = torch.zeros(V, V, V, dtype=torch.float64)
    q64 = q0.double()
    for c1, c2 in itertools.permutations(SUPPORT, 2):
        pc = float(q64[c1] * q64[c2] / (1 - q64[c1]))
        for b1, b2 in itertools.product(SUPPORT, repeat=2):
            pb = pc * float(q1[c1][b1]) * float(q1[c2][b2])
            if pb == 0:
                continue
            spec = Speculation([], Fork(q0, NO_REPLACEMENT, [branch(c1, b1, q0, q1), branch(c2, b2, q0, q1)], 0))
            feed = Feed((LAST,), 0, (2, 2))
            rows = [target_row(()), target_row((c1,)), target_row((c1, b1)), target_row((c2,)), target_row((c2, b2))]
            logits = torch.stack(rows).log()  # softmax at T = 1 gives the rows back

            def run(draws, spec=spec, feed=feed, logits=logits):
                state.generator = draws
                return resolve(state, spec, feed, logits, []).tokens

            for tokens, pr in outcomes(run):
                complete(out, tuple(tokens[:3]), pb * pr)
    return out


def branch(c: int, b: int, q0, q1) -> Branch:
    return Branch(Drafted(c, q0, float(q0[c])), [Drafted(b, q1[c], float(q1[c][b]))])


def complete(out: torch.Tensor, emitted: tuple[int, ...], prob: float) -> None:
    """Add `prob` of an emitted prefix, completed to three tokens by the target's own rows."""
    if len(emitted) == 3:
        out[emitted] += prob
        return
    row = target_row(emitted).double()
    for y in SUPPORT:
        if row[y] > 0:
            complete(out, emitted + (y,), prob * float(row[y]))


def target_outputs() -> torch.Tensor:
    out = torch.zeros(V, V, V, dtype=torch.float64)
    complete(out, (), 1.0)
    return out


@pytest.fixture
def sampled_state(tiny_engine):
    cfg = GenerationConfig(method="specbranch", temperature=1.0)
    return RunState(tiny_engine.pair, cfg, None, None, tokens=[2, LAST], prompt_len=1, eos_ids=set())


@pytest.fixture(params=[True, False], ids=["in turn", "at once"])
def judging(request, monkeypatch):
    """Both ways verdict.judge reads a sampled pass: in turn (a CPU's, judge_in_turn) and at once (a GPU's)."""
    real = verdicts.judge
    monkeypatch.setattr(verdicts, "judge", lambda *args: real(*args, in_turn=request.param))
    return real


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_tree_rule_is_exact_sampled(sampled_state, judging, seed):
    q0 = dist(seed)
    q1 = {c: dist(100 * seed + c) for c in SUPPORT}
    got, want = exact_outputs(sampled_state, q0, q1), target_outputs()
    assert abs(float(got.sum()) - 1.0) < 1e-6
    assert float((got - want).abs().max()) < 1e-6


@pytest.mark.parametrize("fault", ["other branch's rows", "the fork's q for a branch token"])
def test_the_enumeration_sees_a_wrong_tree_rule(sampled_state, judging, monkeypatch, fault):
    """Negative controls, at the same enumeration: each fault biases the first three tokens by far more than the
    tolerance above (total variation over 0.01, against 1e-6)."""
    real = verdicts.judge  # judging's: in turn, or at once

    def judge(state, spec, feed, logits):
        if fault == "other branch's rows":  # branch 1 judged by branch 0's rows
            feed = Feed(feed.committed, feed.path, feed.branches)
            logits = torch.cat([logits[:3], logits[1:3]])
        else:  # a branch token judged against the row its candidate was drawn from
            for b in spec.fork.branches:
                b.tokens[0].q = spec.fork.q
        return real(state, spec, feed, logits)

    monkeypatch.setattr(verdicts, "judge", judge)
    q0, q1 = dist(0), {c: dist(c) for c in SUPPORT}
    got, want = exact_outputs(sampled_state, q0, q1), target_outputs()
    tv = float((got - want).abs().sum()) / 2
    print(f"{fault}: total variation {tv:.4f}")
    assert tv > 0.01


def test_in_turn_only_the_verdicts_that_count_are_computed(sampled_state):
    """judge_in_turn (a CPU's) computes the fork's verdict only where the path holds up, and then the surviving
    branch's alone; at once (a GPU's), every verdict the rows reach."""
    q0, q1 = dist(0), {c: dist(c) for c in SUPPORT}
    fork = Fork(q0, NO_REPLACEMENT, [branch(2, 3, q0, q1), branch(3, 4, q0, q1)], 1)
    missed = Speculation([Drafted(6, dist(0, [6]), 1.0)], fork)  # the target's rows have no mass on token 6
    logits = torch.stack([target_row(())] * 6).log()  # [LAST, 6, c1, b1, c2, b2]'s rows
    feed = Feed((LAST,), 1, (2, 2))
    j = verdicts.judge(sampled_state, missed, feed, logits, in_turn=True)
    assert (j.path.accepted, j.path.bonus, j.fork, j.branches) == (0, False, None, [])
    j = verdicts.judge(sampled_state, missed, feed, logits, in_turn=False)
    assert j.path.accepted == 0 and j.fork is not None and all(b is not None for b in j.branches)
    fed, seen = Feed((LAST,), 0, (2, 2)), set()
    for _ in range(40):  # no path: the fork's row judges the candidates, on fresh draws each time
        j = verdicts.judge(sampled_state, Speculation([], fork), fed, logits[:5], in_turn=True)
        judged = [i for i, b in enumerate(j.branches) if b is not None]
        assert judged == ([] if j.fork.index is None else [j.fork.index])
        seen.add(j.fork.index)
    assert {0, 1} <= seen  # both branches survived at some draw: each was judged alone


# ---------------------------------------------------------------- a scripted pair: rescues that save target passes

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(2, 16)]  # V = 16
TRAPS = {5: 13, 11: 3}  # at these tokens the draft's first choice is wrong (this token), its second the target's


def successor(i: int) -> int:
    return 2 if i == 15 else i + 1


def bigram_llama(path, table: dict[int, dict[int, float]]):
    """A real transformers Llama that is a bigram table: one-hot embeddings, a decoder layer that adds nothing
    (its output projections zero), so the final norm's state is the current token's one-hot (times 4) and the head
    reads table[token] as the next token's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, eos_token_id=1,
        bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(16))
        for norm in (model.model.norm, model.model.layers[0].input_layernorm):
            norm.weight.fill_(1.0)
        model.model.layers[0].post_attention_layernorm.weight.fill_(1.0)
        for i, logits in table.items():
            for j, v in logits.items():
                model.lm_head.weight[j, i] = v / 4  # the final norm makes the one-hot state 4 at i
    model.save_pretrained(path)
    tiny_tokenizer(WORDS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bigram_pair(tmp_path_factory):
    from engine.models.loading import load_pair

    root = tmp_path_factory.mktemp("bigram")
    target = {i: {successor(i): 12.0} for i in range(2, 16)}
    draft = {i: {successor(i): 12.0} for i in range(2, 16)}
    for i, wrong in TRAPS.items():  # unsure, and wrong: the target's token is its second choice
        draft[i] = {wrong: 5.0, successor(i): 4.8}
    return load_pair(
        str(bigram_llama(root / "target", target)), str(bigram_llama(root / "draft", draft)), device="cpu",
        draft_matmul="float32",
    )  # fmt: skip


def test_rescues_save_target_passes(bigram_pair, monkeypatch):
    """Greedy, γ 6, the draft leading each pass by a block (head start) and stepping twice beside it (a rule, not
    this machine's timing): PEARL is corrected at every trap and starts over; SpecBranch forks there (ε 0.6: the
    draft is 0.5 sure) and the target verifies both branches in one pass, so the rescued branch's tokens count in
    that pass. Same output as AR; fewer target passes."""
    from engine.engine import Engine

    schedule_draft(monkeypatch, lambda state: 1)
    engine = Engine(bigram_pair)
    try:
        prompt, new = [2, 3], 60
        want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=new)).token_ids
        assert want[:4] == [4, 5, 6, 7]  # the target's cycle
        passes = {}
        for method in ("pearl", "specbranch"):
            cfg = GenerationConfig(method=method, max_new_tokens=new, gamma=6, epsilon=0.6, head_start=1e-9)
            r = engine.run(prompt, cfg)
            assert r.token_ids == want
            passes[method] = sum(1 for e in r.events if isinstance(e, TimingSpan) and e.kind == "verify")
            if method == "specbranch":
                assert r.metrics["branch_rescues"] >= 4
                rescued_verdicts = [e for e in r.events if isinstance(e, Verified) and e.branch >= 2]
                assert sum(e.accepted for e in rescued_verdicts) >= 6  # branch tokens taken in the rescuing pass
        assert passes["specbranch"] < passes["pearl"], passes
    finally:
        engine.close()


def test_tree_tokens_verify_branches_beside_a_full_path(bigram_pair, monkeypatch):
    """γ 3, so the path often fills γ before the draft forks at a trap: with no room left under γ, the branches wait
    for the next pass (tree_tokens 0); with tree_tokens 3 the target verifies them beside the full path in the same
    pass, a wider tree. Same output as AR; fewer target passes, and passes wider than any without it."""
    from engine.engine import Engine

    schedule_draft(monkeypatch, lambda state: 3)
    engine = Engine(bigram_pair)
    try:
        prompt, new = [2, 3], 60
        want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=new)).token_ids
        passes, widest = {}, {}
        for extra in (0, 3):
            cfg = GenerationConfig(
                method="specbranch", max_new_tokens=new, gamma=3, epsilon=0.6, head_start=1e-9, tree_tokens=extra
            )
            r = engine.run(prompt, cfg)
            assert r.token_ids == want
            spans = [e.tokens for e in r.events if isinstance(e, TimingSpan) and e.kind == "verify"]
            passes[extra], widest[extra] = len(spans), max(spans)
        assert passes[3] < passes[0] and widest[3] > widest[0], (passes, widest)
    finally:
        engine.close()
