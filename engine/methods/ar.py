"""Plain autoregressive decoding of the target: the baseline every speedup is measured against."""

from __future__ import annotations

from engine.methods.decoding import RunState, decode_one_token, step_loop


def autoregressive_decode(state: RunState):
    async def step(events):
        await decode_one_token(state, events)

    return step_loop(state, step)
