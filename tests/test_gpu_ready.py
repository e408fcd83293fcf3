"""Issue 41, "GPU-ready without a GPU": what can be checked on the CPU of the engine's device hygiene.

Verification computes on the rows' own device and reads the host once per round (sampling.to_host): no other
read of a tensor's value (float(), .item(), .tolist(), bool(), int()) happens while a verdict is computed, and an
engine run reads the host once per verify pass and once per draft step (every read on its loop's thread counted,
whatever the call)."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.config import GenerationConfig
from engine.events import VERIFY, BranchResolved, DraftProposed, TimingSpan, Verified
from engine.methods import sampling
from engine.methods import verdict as verdicts
from engine.methods.sampling import NO_REPLACEMENT, TOPK, logits_to_probs, verify_block, verify_candidates

from .conftest import make_tiny_model

HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts sampling.to_host calls, and fails any other read of a tensor's value while it is installed."""
    calls = {"to_host": 0, "inside": False}
    real_to_host = sampling.to_host

    def to_host(values):
        calls["to_host"] += 1
        calls["inside"] = True
        try:
            return real_to_host(values)
        finally:
            calls["inside"] = False

    def guarded(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if not calls["inside"]:
                raise AssertionError(f"Tensor.{name} read the device outside to_host")
            return real(self, *args, **kwargs)

        return read

    monkeypatch.setattr(sampling, "to_host", to_host)
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, guarded(name))
    return calls


def rows(seed: int, n: int, vocab: int = 50, temperature: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return logits_to_probs(torch.randn(n, vocab, generator=g) * 3, temperature, top_k=20)


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("bonus_row", [True, False])
def test_verify_block_reads_the_host_once(host_reads, greedy, bonus_row):
    t = 0.0 if greedy else 1.0
    for seed in range(20):
        q, p = rows(seed, 4, temperature=t), rows(100 + seed, 5 if bonus_row else 4, temperature=t)
        tokens = q.argmax(-1).numpy().tolist()  # numpy: not a read the guard counts
        before = host_reads["to_host"]
        verdict = verify_block(tokens, q, p, torch.Generator().manual_seed(seed), greedy)
        assert host_reads["to_host"] == before + 1
        assert 0 <= verdict.accepted <= 4 and len(verdict.p) == len(verdict.q) == len(verdict.u)


@pytest.mark.parametrize("greedy, scheme", [(True, TOPK), (False, NO_REPLACEMENT)])
def test_verify_candidates_reads_the_host_once(host_reads, greedy, scheme):
    t = 0.0 if greedy else 1.0
    for seed in range(20):
        q, p = rows(seed, 1, temperature=t)[0], rows(100 + seed, 1, temperature=t)[0]
        cands = torch.topk(q if not greedy else rows(seed, 1)[0], 3).indices.numpy().tolist()
        before = host_reads["to_host"]
        cv = verify_candidates(p, q, cands, scheme, torch.Generator().manual_seed(seed), greedy)
        assert host_reads["to_host"] == before + 1
        assert cv.index is None or cv.token == cands[cv.index]


@pytest.mark.parametrize(
    "method, extra",
    [
        ("sd", {}),
        ("pearl", {}),
        ("specbranch", dict(branches=3, epsilon=1.0)),
        ("specbranch", dict(branches=3, epsilon=1.0, temperature=1.0)),
        ("sd", dict(temperature=0.8, top_k=5)),
    ],
)
def test_an_engine_run_reads_one_verdict_per_verify_pass(tiny_engine, method, extra, monkeypatch):
    """Every read of a tensor's value on the loop's thread (the thread that runs the engine between and beside the
    forwards) is caught, whatever the call (tolist, item, float, int, bool, index, numpy: a TorchFunctionMode sees
    them all), and counted: one per target verify pass (its verdict, forks and branches included), one per draft
    step (its row or rows, read once), one per fork (its candidates); the prefill's few and the draft's uniforms,
    drawn 64 at a time, are the slack. A read per drafted token (a float() of q, a top-k for the UI) would add tens.
    Sampled verdicts are judged as on a GPU, at once (verdict.judge's in_turn=False): on a CPU, where a read costs
    nothing, the loop judges them in turn, a read per verdict that counts (test_tree_verification.py)."""
    real = verdicts.judge
    monkeypatch.setattr(verdicts, "judge", lambda *args: real(*args, in_turn=False))
    cfg = GenerationConfig(method=method, max_new_tokens=32, gamma=3, **extra)
    with HostReads() as reads:
        result = tiny_engine.run([2, 3, 4], cfg)
    spans = [e for e in result.events if isinstance(e, TimingSpan)]
    passes = sum(1 for e in spans if e.worker == "target" and e.kind == VERIFY)
    draft_steps = sum(1 for e in spans if e.worker == "draft" and e.kind != "prefill")
    forks = sum(1 for e in result.events if isinstance(e, DraftProposed) and e.kind == "candidates")
    assert passes and passes <= reads.count <= passes + draft_steps + forks + 8, sorted(reads.where.items())
    assert sum(isinstance(e, Verified) and e.branch == 0 for e in result.events) == passes
    if method == "specbranch":  # forks were judged, in the same transfers as their paths
        assert any(isinstance(e, BranchResolved) for e in result.events)


class HostReads(TorchFunctionMode):
    """Counts every read of a tensor's value made on this thread while it is entered, by call site."""

    NAMES = frozenset(HOST_READS + ("numpy",))

    def __init__(self):
        super().__init__()
        self.count, self.where = 0, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.count += 1
            frame = traceback.extract_stack(limit=3)[0]
            site = f"{func.__name__} {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
            self.where[site] = self.where.get(site, 0) + 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- emit decodes incrementally
TRICKY = [
    "héllo 🎉🇯🇵 日本語のテキスト、そして  spaced   out . , !",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, e\u0301 combining, Ωμέγα, 中文字符串测试, emoji at the end 🎉",
    "   leading spaces, tabs\tand\nnew lines\n\n   🤖" * 6,
]


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    from engine.models.loading import dequantized_gguf_dir, embedded_gguf_path

    return AutoTokenizer.from_pretrained(dequantized_gguf_dir(embedded_gguf_path()))


def counted(tokenizer, calls: list[int]):
    """The tokenizer's own decode, counting the tokens each call is given."""
    real = tokenizer.decode

    def decode(ids, *args, **kwargs):
        calls.append(len(ids))
        return real(ids, *args, **kwargs)

    return decode


@pytest.mark.parametrize("text", TRICKY)
def test_emit_sends_the_full_decode_and_decodes_a_bounded_window(tmp_path, real_tokenizer, monkeypatch, text):
    """The text emit has sent after each step is the whole output's decode (less a trailing incomplete character,
    until the run ends), with special tokens skipped; a step decodes a bounded number of tokens, however long the
    output already is (the whole output each step was O(n^2) in its length)."""
    from engine.methods.decoding import RunState, emit
    from engine.models.loading import load_pair
    from engine.runtime import Worker

    tok = real_tokenizer
    special = tok.all_special_ids[0]
    ids = tok.encode(text)
    ids = ids[:7] + [special] + ids[7:]  # a special token in the middle: skipped in the text
    pair = load_pair(str(make_tiny_model(tmp_path / "target", seed=1, context=1024)), None, device="cpu")
    pair.target.tokenizer = tok
    prompt = [5, 6]
    state = RunState(
        pair,
        GenerationConfig(method="ar", max_new_tokens=len(ids)),
        Worker("t"),
        Worker("d"),
        list(prompt),
        len(prompt),
        {-1},
    )
    ids = ids[: state.budget]  # the tiny model's context
    assert len(ids) >= 40
    state.budget = len(ids)
    whole_of = lambda ids: type(tok).decode(tok, ids, skip_special_tokens=True)  # noqa: E731 - not counted
    calls: list[int] = []
    monkeypatch.setattr(tok, "decode", counted(tok, calls))
    sent, at, sizes = "", 0, [1, 3, 2, 5, 1, 4, 2]
    complete = [0, 0]  # output lengths after a step where the output's text ended on a whole character
    for i in range(len(ids)):
        if at >= len(ids):
            break
        chunk = ids[at : at + sizes[i % len(sizes)]]
        at += len(chunk)
        calls.clear()
        sent += emit(state, chunk, ["target"] * len(chunk)).text
        whole = whole_of(ids[:at])
        assert sent == (whole if state.finish_reason else whole.rstrip("\ufffd"))
        # the step's decode work: from the last-but-one place its text was whole (the context of the last one), twice
        # at most, and one piece per new token; never the whole output
        assert sum(calls) <= 2 * (at - complete[-2]) + len(chunk), (calls, at, complete)
        if not whole.endswith("\ufffd"):
            complete.append(at)
    assert len(complete) > 10 and max(b - a for a, b in zip(complete, complete[1:])) < 16
    assert state.finish_reason == "length" and sent == whole_of(ids)
