"""Views of an LM that change what its forward returns: LastRow, the view a prefill reads (decoding.prefill).

Its own module because both kinds of LM hand it out: models.loading.LM and drafts.process.RemoteLM (a draft in a
process of its own), and loading imports process.
"""

from __future__ import annotations

import torch


class LastRow:
    """An LM seen by a caller that reads only the last row of each pass's logits (decoding.prefill): its forward is
    the LM's with last_only=True (the LM head on one row, logits [B, 1, V]); every other attribute is the LM's."""

    def __init__(self, lm):
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, cache, hidden_states: bool = False, features: bool = False):
        return self.lm.forward(input_ids, cache, hidden_states, features, last_only=True)

    def __getattr__(self, name: str):
        return getattr(self.lm, name)
