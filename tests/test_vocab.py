"""Vocabulary-wide reads on the host through numpy (engine/kernels/vocab.py; sampling.read_argmax and read_top) pick
what torch's own pick: each row's argmax is the first index of its largest value (a NaN counting as the largest), on
rows with ties, NaNs, infinities and strided views; a probability row's k largest are torch.topk's values and
indices on rows without ties, a tie goes to the first index, and the caller's rows are left as they were. Where numpy
cannot read a tensor (bfloat16) torch's own runs, with the same result. A draft row's q is the row its settings make,
the untempered row itself where they leave it as it is; a branch step's k rows read as each row alone."""

from __future__ import annotations

import pytest
import torch

from engine.config import GenerationConfig
from engine.kernels.vocab import argmax
from engine.methods.decoding import RunState
from engine.methods.sampling import logits_to_probs, read_argmax, read_top


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_picks_torchs_token_on_ties_nans_infinities_and_views(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 49152, generator=g).to(dtype)
    x[3, 17], x[3, 9000] = float("nan"), float("nan")  # the first NaN wins
    x[5] = float("-inf")  # all equal: index 0
    x[6, 40000] = float("inf")
    ties = torch.randint(0, 4, (64, 512), generator=g).to(dtype)  # most rows' largest value is tied
    for rows in (x, x[:, 100:], x[::3, ::2], x.t()[:, :7].t(), ties):
        assert torch.equal(argmax(rows), rows.argmax(-1))
        assert read_argmax(rows) == rows.argmax(-1).tolist()
        assert torch.equal(argmax(rows[1]), rows[1].argmax(-1))
    with torch.inference_mode():
        assert read_argmax(x) == x.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_top_gives_torch_topk_without_ties_and_leaves_the_rows_alone(dtype):
    g = torch.Generator().manual_seed(2)
    probs = torch.randn(6, 49152, generator=g).mul(3).softmax(-1).to(dtype)
    kept = probs.clone()
    for k in (1, 2, 3, 5):
        want = torch.topk(probs, k)
        values, ids = read_top(probs, k)
        assert ids == want.indices.tolist() and values == want.values.double().tolist()
        (values,), (ids,) = read_top(probs[4:5], k)  # one row, as read_row reads it
        assert ids == want.indices[4].tolist() and values == want.values[4].double().tolist()
    assert torch.equal(probs, kept)  # read, not written


def test_read_top_gives_a_tie_to_the_first_token():
    values, ids = read_top(torch.tensor([[0.1, 0.3, 0.0, 0.3, 0.3], [0.0, 1.0, 0.0, 0.0, 0.0]]), 4)
    assert ids == [[1, 3, 4, 0], [1, 0, 2, 3]]
    assert values[0] == pytest.approx([0.3, 0.3, 0.3, 0.1]) and values[1] == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("settings", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 50, 1.0), (1.0, 0, 0.9)])
def test_a_draft_rows_q_is_the_row_its_settings_make(settings):
    """read_row and read_rows take q from the untempered row they computed already where the settings leave the row as
    it is (RunState.probs_beside): at T = 1 without top-k or top-p logits_to_probs gives those very bits; any
    setting that changes the row makes its own."""
    temperature, top_k, top_p = settings
    state = RunState.__new__(RunState)  # probs and probs_beside read only the settings
    state.cfg = GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(4)) * 3
    logits[:, 8192:] = float("-inf")  # a reduced head's row
    raw = logits.float().softmax(-1)
    q = state.probs_beside(logits, raw)
    assert torch.equal(q, logits_to_probs(logits, temperature, top_k, top_p))
    assert (q is raw) == (settings == (1.0, 0, 1.0))


@pytest.mark.parametrize("settings", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 0.9)])
def test_a_branch_steps_rows_read_as_each_row_alone(settings):
    """read_rows on a branch step's k rows gives, row by row, what read_row gives on that row alone with the same draw:
    the token (greedy: the argmax; sampled: the row's q inverted at the draw's uniform, sample_at as the reference),
    its q row, its confidence and q(token), the row's largest probability and the UI's alternatives."""
    from engine.methods.decoding import read_row
    from engine.methods.drafting import read_rows
    from engine.methods.sampling import NextDraw, draw_u, sample_at

    temperature, top_k, top_p = settings
    state = RunState.__new__(RunState)  # the reads use only the settings
    state.cfg = GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 4096, generator=g) * 4  # [k, V]
    draws = [NextDraw(temperature, top_k, top_p, draw_u(g) if temperature else 0.0) for _ in range(3)]
    rows = read_rows(state, logits, draws)
    assert len(rows) == 3 and len({row.token for row in rows}) == 3
    for row, x, draw in zip(rows, logits, draws):
        alone, raw = read_row(state, x, draw, 1), x.softmax(-1)
        assert (row.token, row.shown) == (alone.token, alone.shown)
        best, conf = float(raw.max()), float(raw[row.token])
        assert row.best == pytest.approx(best) and alone.top[0] == pytest.approx(best)
        assert row.conf == pytest.approx(conf) and alone.conf == pytest.approx(conf)
        if temperature == 0.0:
            assert row.token == int(x.argmax()) and row.q is None and row.q_x == 1.0
        else:
            q = logits_to_probs(x, temperature, top_k, top_p)
            torch.testing.assert_close(row.q, q)
            assert row.token == sample_at(q, draw.u) and row.q_x == pytest.approx(float(q[row.token]))
