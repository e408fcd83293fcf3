"""Issue 41, "GPU-ready without a GPU": what can be checked on the CPU of the engine's device hygiene.

Verification computes on the rows' own device and reads the host once per round (sampling.to_host): no other
read of a tensor's value (float(), .item(), .tolist(), bool(), int()) happens while a verdict is computed, and an
engine run makes exactly one such transfer per target verify pass, forks and their branches included."""
from __future__ import annotations

import pytest
import torch

from engine.config import GenerationConfig
from engine.events import VERIFY, BranchResolved, TimingSpan, Verified
from engine.methods import sampling
from engine.methods.sampling import NO_REPLACEMENT, TOPK, logits_to_probs, verify_block, verify_candidates

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


@pytest.mark.parametrize("method, extra", [
    ("sd", {}), ("pearl", {}), ("specbranch", dict(branches=3, epsilon=1.0)),
    ("specbranch", dict(branches=3, epsilon=1.0, temperature=1.0)), ("sd", dict(temperature=0.8, top_k=5))])
def test_an_engine_run_reads_one_verdict_per_verify_pass(tiny_engine, monkeypatch, method, extra):
    calls = []
    real_to_host = sampling.to_host
    monkeypatch.setattr(sampling, "to_host", lambda values: calls.append(values.numel()) or real_to_host(values))
    cfg = GenerationConfig(method=method, max_new_tokens=32, gamma=3, **extra)
    result = tiny_engine.run([2, 3, 4], cfg)
    passes = [e for e in result.events if isinstance(e, TimingSpan) and e.worker == "target" and e.kind == VERIFY]
    assert passes and len(calls) == len(passes)
    assert sum(isinstance(e, Verified) and e.branch == 0 for e in result.events) == len(passes)
    if method == "specbranch":  # forks were judged, in the same transfers as their paths
        assert any(isinstance(e, BranchResolved) for e in result.events)
