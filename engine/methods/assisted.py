"""`hf-assisted`: transformers' own assisted generation (`generate(assistant_model=...)`) on the same
pair, as an external peer in the bench. It is a black box to us: we see the tokens as its streamer
receives them, not its drafts. Its tokens/s counts from the first streamed tokens (which arrive after
its prefill and first step) to the end, so that prefill is excluded as for our methods."""

from __future__ import annotations

import time

import torch

from engine.events import TARGET, Event, TimingSpan
from engine.methods.decoding import RunState, emit
from engine.runtime import settled


class _Clock:
    """A transformers streamer that only timestamps what arrives."""

    def __init__(self):
        self.times: list[tuple[float, int]] = []
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def _generate(state: RunState, streamer: _Clock) -> list[int]:
    target, draft = state.pair.target.model, state.pair.draft.model
    kwargs = (
        dict(do_sample=False)
        if state.cfg.greedy
        else dict(
            do_sample=True, temperature=state.cfg.temperature, top_p=state.cfg.top_p, top_k=state.cfg.top_k or None
        )
    )
    torch.manual_seed(state.cfg.seed)
    with torch.inference_mode():
        out = target.generate(
            torch.tensor([state.tokens], device=target.device),
            assistant_model=draft,
            max_new_tokens=state.budget,
            streamer=streamer,
            pad_token_id=state.pair.tokenizer.eos_token_id,
            **kwargs,
        )
    return out[0, state.prompt_len :].tolist()


async def assisted_decode(state: RunState):
    clock = _Clock()
    tokens, span = await state.target_worker.run(_generate, state, clock, kind="assisted_generate", step=0, t0=state.t0)
    events: list[Event] = [settled(span)]
    if clock.times:  # decode time starts when the first tokens were streamed
        state.decode_start = clock.times[0][0] - state.t0
        state.prefill_s = state.decode_start
        first = clock.times[0][1]
        events.append(TimingSpan("target", "prefill", 0, 0.0, round(state.decode_start, 6), 0))
        events.append(emit(state, tokens[:first], [TARGET] * first))
        state.step = 1
        if tokens[first:]:
            events.append(emit(state, tokens[first:], [TARGET] * (len(tokens) - first)))
    for e in events:
        yield e
