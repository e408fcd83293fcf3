"""State and primitives shared by every decoder: prefill, decode_one_token, draft_block,
verify_and_commit, emit. The decoders (ar.py, sd.py, ...) are short loops over these.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from engine.config import GenerationConfig
from engine.drafts.process import step_fn
from engine.events import (
    BONUS,
    CORRECTION,
    DECODE,
    DRAFT,
    PREFILL,
    TARGET,
    VERIFY,
    DraftProposed,
    Event,
    Rollback,
    StepStarted,
    TokensEmitted,
    Verified,
)
from engine.methods.sampling import (
    ALTERNATIVES,
    NextDraw,
    alternatives,
    greedy_block,
    logits_to_probs,
    read_argmax,
    read_top,
    sample,
    to_host,
    verify_block,
)
from engine.models import cache as kv
from engine.models.loading import LM, ModelPair, Out
from engine.runtime import Worker, settled

UNIFORM_BATCH = 64  # the draft's uniforms drawn at a time (RunState.uniforms)


@dataclass
class RunState:
    """Everything one generation owns. Caches are per run, so a cancelled run leaves nothing behind."""

    pair: ModelPair
    cfg: GenerationConfig
    target_worker: Worker
    draft_worker: Worker
    tokens: list[int]  # prompt + committed output
    prompt_len: int
    eos_ids: set[int]
    t0: float = field(default_factory=time.perf_counter)
    step: int = 0
    finish_reason: str | None = None
    decode_start: float = 0.0
    prefill_s: float = 0.0
    text: TextStream = None  # the output's text, decoded as it grows (emit)
    generator: torch.Generator = field(default_factory=torch.Generator)  # verification draws
    draft_generator: torch.Generator = field(default_factory=torch.Generator)  # the draft's own samples
    draft_uniforms: list[float] = field(default_factory=list)  # drawn from it ahead, a batch at a time (uniforms)
    probe_generator: torch.Generator = field(default_factory=torch.Generator)  # forks a sampled SpecBranch run
    # plays out where it made none, for its rescue table only (verdict.missed_rescue): never the output's draws
    target_len: int = 0  # how many tokens the target cache holds: a prefix of `tokens` (parallel methods)
    target_cache: object = None
    draft_cache: object = None
    budget: int = 0  # max new tokens, capped by the context length
    hrad_samples: list | None = None  # when set: (emitted index, H-RAD features, draft confidence) are collected here

    def __post_init__(self):
        self.text = TextStream(self.pair.tokenizer, self.prompt_len)
        self.generator.manual_seed(self.cfg.seed)
        self.draft_generator.manual_seed(self.cfg.seed + 1_000_003)
        self.probe_generator.manual_seed(self.cfg.seed + 2_000_003)
        self.target_cache = self.pair.target.new_cache()
        if self.pair.draft is not None:
            self.draft_cache = self.pair.draft.new_cache()
        room = (
            min(self.pair.target.context_length, self.pair.draft.context_length if self.pair.draft else 1 << 30)
            - self.prompt_len
        )
        self.budget = min(self.cfg.max_new_tokens, room)

    @property
    def emitted(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.budget - self.emitted

    @property
    def head_draft(self) -> bool:
        """The draft is a feature-conditioned head: it reads the target's features, which the target's
        forwards hand over (`share_features`) instead of the draft prefilling on its own."""
        return bool(getattr(self.pair.draft, "reads_target_features", False))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return logits_to_probs(logits, c.temperature, c.top_k, c.top_p)

    def probs_beside(self, logits: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """probs(logits), where raw = logits.float().softmax(-1) was computed already: raw itself where the settings
        leave the row as it is (T = 1, no top-k, no top-p: logits_to_probs runs the same ops, to the same bits)."""
        c = self.cfg
        return raw if c.temperature == 1.0 and c.top_k <= 0 and c.top_p >= 1.0 else self.probs(logits)

    def next_draws(self, rows: int) -> list[NextDraw]:
        """How each of `rows` draft rows will pick its next token, drawn before the forward that computes them (the
        draft's own generator; no draw when greedy), so a draft in its own process can step on them ahead."""
        c = self.cfg
        us = [0.0] * rows if c.greedy else self.uniforms(rows)
        return [NextDraw(c.temperature, c.top_k, c.top_p, u) for u in us]

    def uniforms(self, n: int) -> list[float]:
        """n uniforms in [0, 1), float64, from the draft's generator: drawn UNIFORM_BATCH at a time, so that a draft
        step reads no random number of its own (one read of a CPU tensor per batch)."""
        while len(self.draft_uniforms) < n:
            self.draft_uniforms += torch.rand(
                UNIFORM_BATCH, generator=self.draft_generator, dtype=torch.float64
            ).tolist()
        out, self.draft_uniforms = self.draft_uniforms[:n], self.draft_uniforms[n:]
        return out

    def pieces(self, ids: list[int]) -> list[str]:
        return self.pair.pieces(ids)


@dataclass(slots=True)
class DraftRow:
    """One draft row [V], read once."""

    top: list[float]  # its largest untempered probabilities, best first (k of them)
    ids: list[int]  # ... their tokens
    token: int  # what its draw picks
    q: torch.Tensor | None  # the exact row the token was drawn from (None when greedy: a point mass)
    conf: float  # the untempered probability of the token
    raw: torch.Tensor  # [V]: the untempered probabilities (a fork's candidates are read from it)
    q_x: float = 1.0  # q(token)
    shown: list[list[float]] = field(default_factory=list)  # the UI's alternatives at the token ([[id, q], ...])


def read_row(state: RunState, logits: torch.Tensor, draw: NextDraw, k: int) -> DraftRow:
    """logits [V] -> DraftRow, in one host read: confidence is read from the untempered distribution; the token from
    the row the sampling settings make (state.probs), at the draw fixed before the forward (greedy: the argmax, a
    point mass; sampled: the inverse CDF at its uniform, on the row's device: NextDraw.pick)."""
    raw = logits.float().softmax(-1)  # [V]
    k = min(k, raw.shape[-1])
    if state.cfg.greedy:
        (top,), (ids,) = read_top(raw[None], k)
        return DraftRow(top, ids, ids[0], None, top[0], raw, 1.0, [[ids[0], 1.0]])
    best = raw.topk(k)
    q = state.probs_beside(logits, raw)  # [V]
    token = draw.pick(q)  # []
    shown = q.topk(min(ALTERNATIVES, q.shape[-1]))
    packed = [best.values, best.indices, token.view(1), raw[token].view(1), q[token].view(1)]
    packed += [shown.values, shown.indices]
    values = to_host(torch.cat([t.double() for t in packed]))
    n = len(best.values)
    top, ids = values[:n], [int(i) for i in values[n : 2 * n]]
    token, conf, q_x = int(values[2 * n]), values[2 * n + 1], values[2 * n + 2]
    a = len(shown.values)
    shown = alternatives(values[2 * n + 3 : 2 * n + 3 + a], values[2 * n + 3 + a :])
    return DraftRow(top, ids, token, q, conf, raw, q_x, shown)


async def forward(
    state: RunState,
    lm: LM,
    worker: Worker,
    cache,
    ids: list[int],
    kind: str,
    events: list[Event],
    hidden_states: bool = False,
    features: bool = False,
    solo: bool = False,
    ahead: int = 0,
    draws: list[NextDraw] | None = None,
    sure: float | None = None,
    tree=None,
    rows: bool = False,
):
    """Feed `ids` (appended to `cache`) on `worker` and record the span. Returns logits [T, V]; with
    hidden_states/features, Out(logits [T, V], every layer's states [1, T, H] each, last features [T, H]).
    solo: the other model waits on this forward (Worker.run). ahead: a draft in its own process steps at once on the
    token `draws` will pick (state.next_draws; None: the argmax), on that many torch threads (draft_process.step_fn;
    0 = not), where its row's largest probability reaches `sure` (Policy.sure_enough; None: always). tree: how the
    ids hang together where they are not one line (llama.TokenTree; the target's verify pass of a fork). rows: each
    id is the next token of its own cache row (a fork's k branches one step each): logits [k, V]."""
    x = torch.tensor([[i] for i in ids] if rows else [ids], dtype=torch.long)  # [k, 1] or [1, T]
    fn = step_fn(lm, ahead, draws, sure) if tree is None else functools.partial(lm.forward, tree=tree)
    out, span = await worker.run(
        fn,
        x,
        cache,
        hidden_states,
        features,
        kind=kind,
        step=state.step,
        t0=state.t0,
        tokens=len(ids),
        solo=solo,
    )
    events.append(span)
    if hidden_states or features:
        return Out(out.logits[0], out.hidden_states, None if out.features is None else out.features[0])
    return out[:, -1] if rows else out[0]


def share_features(state: RunState, start: int, feats: torch.Tensor | None, keep: int) -> None:
    """Hand a head draft the target's features for the committed positions [start, keep) of a forward that
    began at position `start`; its rows built on predictions of those are re-fed at the next draft step."""
    if state.head_draft and feats is not None and keep > start:
        state.draft_cache.set_target_features(start, feats[: keep - start])


def crop_draft(state: RunState, keep: int) -> None:
    """Roll the draft cache back to at most `keep` positions (and, for a head, to its first stale row)."""
    n = min(kv.cache_length(state.draft_cache), keep)
    if state.head_draft:
        n = min(n, state.draft_cache.stale_from())
    kv.rollback(state.draft_cache, n)


async def prefill(state: RunState, events: list[Event]) -> None:
    """Run the prompt through the target and the draft (at once, on their workers) and commit the
    target's first token. A head draft waits for the target's features instead (its first step feeds them)."""
    prompt = state.tokens
    jobs = [
        forward(
            state,
            state.pair.target.last_row,
            state.target_worker,
            state.target_cache,
            prompt,
            PREFILL,
            events,
            features=True,
        )
    ]
    if state.pair.draft is not None and not state.head_draft:
        draft = state.pair.draft.last_row  # its logits are not read: the head on one row, not the prompt's every row
        jobs.append(forward(state, draft, state.draft_worker, state.draft_cache, prompt, PREFILL, events))
    out = (await asyncio.gather(*jobs))[0]
    share_features(state, 0, out.features, len(prompt))
    state.prefill_s = state.now()
    state.decode_start = state.prefill_s
    token = sample(state.probs(out.logits[-1]), state.generator)
    events.append(emit(state, [token], [TARGET]))


async def decode_one_token(state: RunState, events: list[Event]) -> None:
    """One plain autoregressive step of the target."""
    feed = state.tokens[kv.cache_length(state.target_cache) :]
    logits = await forward(state, state.pair.target, state.target_worker, state.target_cache, feed, DECODE, events)
    # greedy: the argmax, which is what sampling the one-hot row gives, without building and inverting the row
    token = read_argmax(logits[-1:])[0] if state.cfg.greedy else sample(state.probs(logits[-1]), state.generator)
    events.append(emit(state, [token], [TARGET]))


async def draft_block(state: RunState, gamma: int, events: list[Event], kind: str = DRAFT):
    """Draft gamma tokens autoregressively on top of the committed tokens, each row read once (read_row).
    Returns their DraftRows; the last drafted token is not fed to the draft cache."""
    draft = state.pair.draft
    feed = state.tokens[kv.cache_length(state.draft_cache) :]  # committed tokens the draft has not seen yet
    rows: list[DraftRow] = []
    for i in range(gamma):
        # the target waits on the whole block: the draft may have the cores (Engine's solo_threads); a draft in its own
        # process takes the block's next step on them, on the token `draw` picks, while this one is read (not after
        # the last: the target's pass comes next)
        ahead = state.draft_worker.solo_threads if i < gamma - 1 else 0
        draw = state.next_draws(1)
        logits = await forward(
            state, draft, state.draft_worker, state.draft_cache, feed, kind, events, solo=True, ahead=ahead, draws=draw
        )
        rows.append(read_row(state, logits[-1], draw[0], 1))
        feed = [rows[-1].token]
    tokens = [r.token for r in rows]
    events.append(
        DraftProposed(
            step=state.step,
            tokens=tokens,
            pieces=state.pieces(tokens),
            q=[r.q_x for r in rows],
            parent_position=len(state.tokens),
            top=[r.shown for r in rows],
        )
    )
    return rows


async def verify_and_commit(state: RunState, rows: list[DraftRow], events: list[Event]):
    """One target forward over [unfed committed tokens, x_1..x_g]; accept a prefix, roll back the rest,
    commit accepted tokens plus the correction or bonus token. Returns the Verdict."""
    tokens = [r.token for r in rows]
    start = kv.cache_length(state.target_cache)
    feed = state.tokens[start:] + tokens
    out = await forward(
        state, state.pair.target, state.target_worker, state.target_cache, feed, VERIFY, events, features=True
    )
    logits = out.logits[-(len(tokens) + 1) :]  # [g + 1, V]: the rows predicting x_1..x_g and the bonus
    if state.cfg.greedy:  # the whole verdict is each row's argmax: one read
        verdict = greedy_block(tokens, read_argmax(logits), True)
    else:
        verdict = verify_block(tokens, torch.stack([r.q for r in rows]), state.probs(logits), state.generator, False)
    n = verdict.accepted
    events.append(
        Verified(
            step=state.step,
            drafted=len(tokens),
            accepted=n,
            p=verdict.p,
            q=verdict.q,
            u=verdict.u,
            next_token=verdict.next_token,
            next_kind=BONUS if verdict.bonus else CORRECTION,
            next_p=verdict.next_p,
            tokens=list(tokens),
            pieces=state.pieces(tokens),
        )
    )
    keep = len(state.tokens) + n
    kv.rollback(state.target_cache, keep)
    share_features(state, start, out.features, keep)
    crop_draft(state, keep)
    if n < len(tokens):
        rejected = tokens[n:]
        events.append(Rollback(state.step, "draft", rejected, state.pieces(rejected), "rejected"))
    kinds = ["accepted"] * n + [BONUS if verdict.bonus else CORRECTION]
    events.append(emit(state, tokens[:n] + [verdict.next_token], kinds))
    return verdict


def emit(state: RunState, tokens: list[int], kinds: list[str]) -> TokensEmitted:
    """Commit tokens, cut at EOS or the token budget, and compute the text delta."""
    tokens, kinds = tokens[: state.remaining], kinds[: state.remaining]
    for i, t in enumerate(tokens):
        if t in state.eos_ids:
            tokens, kinds = tokens[: i + 1], kinds[: i + 1]
            state.finish_reason = "eos"
            break
    state.tokens.extend(tokens)
    if state.finish_reason is None and state.remaining <= 0:
        state.finish_reason = "length"
    delta = state.text.delta(state.tokens, final=state.finish_reason is not None)
    return TokensEmitted(state.step, tokens, state.pieces(tokens), kinds, delta)


class TextStream:
    """The output's text, decoded incrementally: after each step, the text sent so far is exactly the whole output's
    decode (skip_special_tokens), less a trailing incomplete multi-byte character ("\ufffd"), held back until the
    tokens that complete it come, or the run ends. The scheme of text-generation-inference and vLLM: decode only a
    window, from `prefix` (the start of the last chunk whose text was complete) to the end; its text past the
    prefix's (the tokens [prefix, read)) is new. The prefix gives the tokenizer the context a piece's text may depend
    on (a SentencePiece word's leading space). So a step decodes the last complete chunk, what is held back, and its
    own tokens, whatever the output's length: decoding the whole output each step was O(n^2) in its length."""

    __slots__ = ("tokenizer", "prefix", "read", "prefix_chars", "sent")

    def __init__(self, tokenizer, start: int):
        self.tokenizer = tokenizer
        self.prefix = self.read = start  # token indices: the window's start; the end of the text sent in full
        self.prefix_chars = 0  # len(decode(tokens[prefix:read]))
        self.sent = 0  # characters of the window past the prefix already sent (before a held-back character)

    def delta(self, tokens: list[int], final: bool) -> str:
        """The text the tokens added since the last call (`final`: the run has ended; nothing is held back)."""
        decode = self.tokenizer.decode
        text = decode(tokens[self.prefix :], skip_special_tokens=True)
        held = text.endswith("\ufffd")
        shown = text.rstrip("\ufffd") if held and not final else text
        new = shown[self.prefix_chars + self.sent :]
        if held and not final:  # the window stays open until the character is complete
            self.sent += len(new)
        else:  # everything up to here is text: the next window starts at this chunk
            self.prefix, self.read, self.sent = self.read, len(tokens), 0
            self.prefix_chars = len(decode(tokens[self.prefix : self.read], skip_special_tokens=True))
        return new


async def step_loop(state: RunState, step) -> AsyncIterator[Event]:
    """The loop every decoder shares: prefill, then `await step(events)` until the run is finished.
    Events are buffered during a step and yielded when it completes."""
    events: list[Event] = []
    late = state.target_worker.cuda or state.draft_worker.cuda  # CUDA spans are read as they are handed on
    await prefill(state, events)
    while True:
        for e in drain(events, late):
            yield e
        if state.finish_reason:
            return
        state.step += 1
        events.append(StepStarted(state.step, len(state.tokens), round(state.now(), 6)))
        await step(events)


def drain(events: list[Event], late: bool = False) -> list[Event]:
    """Hand the buffered events to the caller and empty the buffer. `late`: a worker is on CUDA, so its spans are
    read from their events now (runtime.settled), once the step's verdict has waited for its forwards."""
    out = events[:]
    events.clear()
    return [settled(e) for e in out] if late else out
