"""Vanilla speculative decoding (Leviathan et al. 2023): draft gamma tokens, verify them in one
target forward, keep the accepted prefix plus a correction or bonus token. Serial: while one model
computes the other waits (the "bubbles" the parallel methods remove)."""

from __future__ import annotations

from engine.methods.decoding import RunState, decode_one_token, draft_block, step_loop, verify_and_commit


def speculative_decode(state: RunState):
    async def step(events):
        gamma = min(state.cfg.gamma, state.remaining - 1)  # the last token needs no draft
        if gamma < 1:
            await decode_one_token(state, events)
            return
        rows = await draft_block(state, gamma, events)
        await verify_and_commit(state, rows, events)

    return step_loop(state, step)
