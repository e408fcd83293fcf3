"""Vanilla speculative decoding (Leviathan et al. 2023): draft gamma tokens, verify them in one
target forward, keep the accepted prefix plus a correction or bonus token. Serial: while one model
computes the other waits (the "bubbles" the parallel methods remove)."""
from __future__ import annotations

from typing import AsyncIterator

from .decoding import RunState, decode_one_token, draft_block, drain, prefill, verify_and_commit
from .events import Event, StepStarted


async def speculative_decode(state: RunState) -> AsyncIterator[Event]:
    events: list[Event] = []
    await prefill(state, events)
    while True:
        for e in drain(events):
            yield e
        if state.finish_reason:
            return
        state.step += 1
        events.append(StepStarted(state.step, len(state.tokens), round(state.now(), 6)))
        gamma = min(state.cfg.gamma, state.remaining - 1)  # the last token needs no draft
        if gamma < 1:
            await decode_one_token(state, events)
            continue
        tokens, q_rows = await draft_block(state, gamma, events)
        await verify_and_commit(state, tokens, q_rows, events)
