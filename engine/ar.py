"""Plain autoregressive decoding of the target: the baseline every speedup is measured against."""
from __future__ import annotations

from typing import AsyncIterator

from .decoding import RunState, decode_one_token, drain, prefill
from .events import Event, StepStarted


async def autoregressive_decode(state: RunState) -> AsyncIterator[Event]:
    events: list[Event] = []
    await prefill(state, events)
    while True:
        for e in drain(events):
            yield e
        if state.finish_reason:
            return
        state.step += 1
        events.append(StepStarted(state.step, len(state.tokens), round(state.now(), 6)))
        await decode_one_token(state, events)
