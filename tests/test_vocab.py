"""Vocabulary-wide reads on the host through numpy (engine/kernels/vocab.py; sampling.read_argmax and read_top) pick
what torch's own pick: each row's argmax is the first index of its largest value (a NaN counting as the largest), on
rows with ties, NaNs, infinities and strided views; a probability row's k largest are torch.topk's values and
indices on rows without ties, a tie goes to the first index, and the caller's rows are left as they were. Where numpy
cannot read a tensor (bfloat16) torch's own runs, with the same result."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.vocab import argmax
from engine.methods.sampling import read_argmax, read_top


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
