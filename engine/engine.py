"""The Engine: a loaded model pair, one worker thread per model, and `generate`, an async generator
of events for any method. Generations on one engine are serialised by a lock (they queue)."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass

import torch

from engine.config import (
    AR,
    ASSISTED,
    FIXED,
    NO_BRANCH,
    PARALLEL,
    PEARL_POLICY,
    SD,
    GenerationConfig,
    SpecBranchError,
)
from engine.events import DECODE, DRAFT, VERIFY, Event, Finished, Notice, RunStarted, TimingSpan, TokensEmitted
from engine.measure.costs import draft_features, forward_costs, target_beside_draft
from engine.measure.metrics import compute_metrics
from engine.methods.ar import autoregressive_decode
from engine.methods.assisted import assisted_decode
from engine.methods.calibration import PRIOR_WEIGHT, RESCUE_BINS, RESCUE_PRIOR_WEIGHT, AcceptanceCalibration
from engine.methods.decoding import RunState
from engine.methods.hrad import find_hrad
from engine.methods.parallel import parallel_decode
from engine.methods.policy import BranchCosts, Policy
from engine.methods.sd import speculative_decode
from engine.models.loading import ModelPair
from engine.runtime import PerProcess, default_solo_threads, model_worker, new_event_loop, run_apart

# the decoders of the methods that are not parallel (a parallel one's also takes its policy: Engine.decoder)
DECODERS = {AR: autoregressive_decode, SD: speculative_decode, ASSISTED: assisted_decode}


@dataclass
class Result:
    method: str
    token_ids: list[int]
    text: str
    metrics: dict
    events: list[Event]
    finish_reason: str


class Engine:
    def __init__(
        self,
        pair: ModelPair,
        threads: int = 1,
        solo_threads: int | None = None,
        measure_target_step: bool = False,
        compile: bool = True,
    ):
        """threads: torch threads per worker. solo_threads: the draft's, for a step the target waits on (SD's block,
        a parallel method's head start), when it has the cores to itself (None: runtime.default_solo_threads()).
        The target always keeps `threads`: on this CPU its 1-token step rounds differently on 2 threads, and the
        output must not depend on how many threads ran it. The draft's numbers may: q is what its pass computed.
        measure_target_step: before its first speculative run, measure the target's one-token step
        (target_step_ms), which each speculative run's RunStarted then carries (the app's glance line reads it);
        off, RunStarted says -1 and no forward runs besides the run's own.
        Each model runs on its worker (runtime.model_worker: one per model, shared with other engines on it), and
        the steps that compile on the thread that calls them (LM.compile_here: the generic kernels', CUDA graphs on a
        GPU) compile here, on that worker's thread; compile=False leaves them eager (gpu-check after a compile that
        failed)."""
        self.pair = pair
        self.measure_target_step = measure_target_step
        self.target_worker = model_worker("target", pair.target, threads)
        self.draft_worker = model_worker(
            "draft", pair.draft, threads, solo_threads or max(threads, default_solo_threads())
        )
        self._said: set[str] = set()  # the compile failures a run's notice has told of
        if compile:
            self._compile_on_workers()
        # one generation at a time per engine; others queue (any event loop). Waits for the lock happen on their own
        # thread, one at a time (so in order), never on a loop's own executor: see _take_busy. Both are this
        # process's (PerProcess): a forked child, as on ZeroGPU, has neither the parent's threads nor its runs
        self._lock = PerProcess(threading.Lock)
        self._waiter = PerProcess(lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-lock"))
        self.hrad, self.hrad_notice = find_hrad(pair)  # H-RAD classifier, when trained weights fit this pair
        self._branch_costs: BranchCosts | None = None
        self._target_step_ms: float | None = None
        self._calibration: dict[tuple, AcceptanceCalibration] = {}

    def _compile_on_workers(self) -> None:
        """Each model's thread-bound steps compiled (and warmed up) on the thread of the worker that will call them."""
        for worker, lm in ((self.target_worker, self.pair.target), (self.draft_worker, self.pair.draft)):
            if getattr(lm, "compiles_here", False):
                worker.executor.submit(lm.compile_here).result()

    @property
    def busy(self) -> bool:
        """Whether a generation holds this engine now (the app's engine cache never closes such an engine)."""
        return self._busy.locked()

    def encode(self, prompt: str, chat: bool, history: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt: raw text, or one user turn (after `history`) in the chat template."""
        return encode_prompt(self.pair.tokenizer, prompt, chat, history)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt_length(prompt_ids, self.pair.target.context_length)

    async def generate(
        self, prompt_ids: list[int], cfg: GenerationConfig, prompt_text: str = "", collect_hrad: list | None = None
    ) -> AsyncIterator[Event]:
        cfg.validate()
        self.check_prompt(prompt_ids)
        if cfg.kind.needs_draft and self.pair.draft is None:
            raise SpecBranchError(f"method {cfg.method!r} needs a draft model")
        if cfg.kind.decoder == ASSISTED and getattr(self.pair.draft, "reads_target_features", False):
            raise SpecBranchError(
                "hf-assisted cannot take a feature-conditioned draft head: transformers' assisted "
                "generation needs a standalone causal LM as its assistant (use --draft embedded)"
            )
        await self._take_busy()
        try:  # aclosing: a consumer that stops early closes every generator below, freeing both workers
            async with aclosing(self._generate(prompt_ids, cfg, prompt_text, collect_hrad)) as stream:
                async for event in stream:
                    yield event
        finally:
            self._busy.release()

    @property
    def _busy(self) -> threading.Lock:
        return self._lock.get()

    @property
    def _busy_waiter(self) -> ThreadPoolExecutor:
        return self._waiter.get()

    async def _take_busy(self) -> None:
        """Wait for the engine's lock without blocking the event loop. Cancel-safe: a request cancelled while it
        waits (Stop, a closed tab) cannot take the lock back from the waiting thread, so that thread's acquire,
        when it returns, releases the lock again. This hangs on the thread's own Future, not on the loop, so
        it works even when the cancelled request's loop is closed by then (app/stream.py closes it)."""
        waiting = self._busy_waiter.submit(self._busy.acquire)
        try:
            await asyncio.wrap_future(waiting)
        except BaseException:
            waiting.add_done_callback(self._release_abandoned)  # runs now if the acquire already returned
            raise

    def _release_abandoned(self, waiting: Future) -> None:
        if not waiting.cancelled() and waiting.exception() is None:  # not cancelled before it ran: it took the lock
            self._busy.release()

    async def _generate(self, prompt_ids, cfg, prompt_text, collect_hrad):
        """The generation itself (the caller holds the engine's lock)."""
        # the host work between forwards (sampling, verification) runs here, on the caller's thread: one torch thread,
        # like each worker's. A caller that never set its count keeps an OpenMP team as wide as the machine, and on 2
        # cores that team takes a core from the workers (docs/models.md: PEARL 16 % slower)
        torch.set_num_threads(1)
        take = getattr(self.pair.draft, "take_compiled", None)  # a draft compiled in a process of its own, if ready
        if take is not None:
            self.pair.draft = take()
        # measured before the run's clock starts; the run's RunStarted carries it (AR's own steps are one-token)
        step_ms = self.target_step_ms() if self.measure_target_step and cfg.kind.needs_draft else -1.0
        state = RunState(
            self.pair, cfg, self.target_worker, self.draft_worker, list(prompt_ids), len(prompt_ids), self.pair.eos_ids
        )
        events: list[Event] = [
            RunStarted(
                cfg.method,
                self.pair.target.name,
                self.pair.draft.name if self.pair.draft else None,
                list(prompt_ids),
                prompt_text,
                cfg.to_dict(),
                str(self.pair.target.device),
                time.time(),
                step_ms,
            )
        ]
        yield events[0]
        state.hrad_samples = collect_hrad
        if cfg.kind.hrad and cfg.hrad and self.hrad is None:
            notice = Notice("warning", f"H-RAD off ({self.hrad_notice}): branching by draft confidence only")
            events.append(notice)
            yield notice
        compiling = compile_notice(self.pair.draft) if cfg.kind.drafts_here else None
        for notice in ([compiling] if compiling else []) + self._eager_notices():
            events.append(notice)
            yield notice
        if state.budget < cfg.max_new_tokens:
            notice = Notice("warning", f"max-new-tokens cut to {state.budget} by the context length")
            events.append(notice)
            yield notice
        checks = 0  # the draft-speed check looks at the first few dozen forwards only
        async with aclosing(self.decoder(state)) as stream:
            async for event in stream:
                events.append(event)
                yield event
                if checks < 40 and isinstance(event, TimingSpan) and cfg.kind.needs_draft:
                    checks += 1
                    notice = slow_draft_notice(events)
                    if notice:
                        checks = 40
                        events.append(notice)
                        yield notice
        decode_s = state.now() - state.decode_start
        done = Finished(
            state.finish_reason or "length", round(state.prefill_s, 6), round(decode_s, 6), state.emitted, {}
        )
        events.append(done)
        metrics = compute_metrics(events)
        yield Finished(done.reason, done.prefill_s, done.decode_s, done.new_tokens, metrics)

    def _eager_notices(self) -> list[Notice]:
        """Once per engine, for each model whose steps were to run compiled and run eager (a compile, or a compiled
        step, that failed: the same output, slower): why."""
        out = []
        for role, lm in (("target", self.pair.target), ("draft", self.pair.draft)):
            why = getattr(lm, "compile_why", "") if lm is not None else ""
            if why and f"{role}: {why}" not in self._said:
                self._said.add(f"{role}: {why}")
                out.append(
                    Notice("warning", f"the {role}'s steps run eager, not compiled (the same output, slower): {why}")
                )
        return out

    def policy(self, cfg: GenerationConfig) -> Policy:
        """Branching policy for the parallel methods: pearl never branches (nor holds back); the ablations of
        SpecBranch drop one part each and keep its rollback-aware hold (cfg.hold)."""
        policy = cfg.kind.policy
        if policy == PEARL_POLICY:
            return Policy(max_branches=1)
        measured = (
            dict(calibration=self.calibration(cfg), rescues=self.calibration(cfg, "rescue")) if cfg.calibrate else {}
        )
        if policy == NO_BRANCH:
            return Policy(max_branches=1, hold=cfg.hold, **measured)
        if policy == FIXED:
            return Policy(
                max_branches=cfg.branches,
                fixed_at=max(0, cfg.gamma // 2 - 1),
                hold=cfg.hold,
                hold_branches=cfg.hold_branches,
                **measured,
            )
        use_hrad = cfg.hrad and cfg.kind.hrad
        return Policy(
            max_branches=cfg.branches,
            epsilon=cfg.epsilon,
            hrad=self.hrad if use_hrad else None,
            costs=self.branch_costs(cfg.branches) if cfg.branch_costs and cfg.branches > 1 else None,
            hold=cfg.hold,
            hold_branches=cfg.hold_branches,
            **measured,
        )

    def calibration(self, cfg: GenerationConfig, table: str = "acceptance") -> AcceptanceCalibration:
        """What this engine's SpecBranch runs measured (engine/methods/calibration.py), kept across runs, one table per
        method (each variant learns from its own runs only, so a bench's rows do not read each other's verdicts) and
        way of sampling (acceptance at T=0 is not acceptance at T=1): "acceptance", of the draft's own token by its
        confidence; "rescue", of a fork's other candidates, where its own was rejected, by the share of the rest
        of the draft's mass they cover (also where the draft made no fork: verdict.missed_rescue)."""
        key = (table, cfg.method, cfg.temperature, cfg.top_k, cfg.top_p)
        if key not in self._calibration:  # the draft's mass on its alternatives is a weaker guess than its confidence
            # (a far-off draft spreads it where the target never goes): let a few rescues, in any bin, outweigh it
            self._calibration[key] = (
                AcceptanceCalibration(RESCUE_PRIOR_WEIGHT, RESCUE_BINS, pooled=True)
                if table == "rescue"
                else AcceptanceCalibration(PRIOR_WEIGHT)
            )
        return self._calibration[key]

    def branch_costs(self, max_rows: int, rounds: int = 3) -> BranchCosts:
        """What a fork costs on this machine, measured once per engine through the workers themselves (so with their
        thread counts, and on CUDA on their streams, timed by their spans), 128 tokens in: a draft step on
        1..max_rows rows alone (the row counts in turn, 15 times: costs.forward_costs), and a target step while the
        draft steps on k rows beside it (in `rounds` rounds over every k, the median kept). A fork's worth is a
        difference of these, and measured one after another they drifted by a third on the 2-core CPU
        (docs/results/README.md)."""
        if self._branch_costs is None or max(self._branch_costs.draft_ms) < max_rows:
            context = min(128, self.pair.target.context_length // 2)
            feats = draft_features(self.pair, context)
            widths = list(range(1, max_rows + 1))

            async def measure():
                draft = await forward_costs(self.draft_worker, self.pair.draft, context, widths, True, 15, feats)
                busy = {k: [] for k in widths}
                for _ in range(rounds):
                    for k in widths:
                        busy[k].append(
                            await target_beside_draft(
                                self.target_worker,
                                self.pair.target,
                                self.draft_worker,
                                self.pair.draft,
                                context,
                                k,
                                feats,
                            )
                        )
                return BranchCosts(draft, {k: statistics.median(v) for k, v in busy.items()})

            self._branch_costs = run_apart(measure)  # a run may ask for it from inside its event loop
        return self._branch_costs

    def target_step_ms(self) -> float:
        """ms of one target forward of one token (the median of 5, 128 tokens in the cache, on the target's worker),
        measured once per engine, about a quarter of a second: what plain decoding costs a token at best. A
        speculative run's RunStarted event carries it, so that its speed can be read against the target's own step
        before any AR run of its prompt exists (the app's glance line); a speculative run's target passes feed
        several tokens each and so never show it."""
        if self._target_step_ms is None:
            context = min(128, self.pair.target.context_length // 2)

            async def measure():
                return (await forward_costs(self.target_worker, self.pair.target, context, [1], False, 5))[1]

            self._target_step_ms = round(run_apart(measure), 3)  # a run asks for it from inside its event loop
        return self._target_step_ms

    @property
    def measured_branch_costs(self) -> BranchCosts | None:
        """What branch_costs measured, None where no run asked for it (--branch-costs)."""
        return self._branch_costs

    def decoder(self, state: RunState):
        decoder = state.cfg.kind.decoder
        if decoder == PARALLEL:
            return parallel_decode(state, self.policy(state.cfg))
        return DECODERS[decoder](state)

    def run(
        self,
        prompt_ids: list[int],
        cfg: GenerationConfig,
        prompt_text: str = "",
        collect_hrad: list | None = None,
        on_event=None,
    ) -> Result:
        """Synchronous helper: run one generation to the end and collect its events
        (each also handed to on_event as it happens, e.g. a session recorder)."""

        async def collect():
            events = []
            async for e in self.generate(prompt_ids, cfg, prompt_text, collect_hrad):
                events.append(e)
                if on_event is not None:
                    on_event(e)
            return events

        loop = new_event_loop()
        try:
            events = loop.run_until_complete(collect())
        finally:
            loop.close()
        return result_from_events(events, self.pair.tokenizer)

    def close(self) -> None:
        if self._waiter.made_here():
            self._busy_waiter.shutdown(wait=False, cancel_futures=True)
        self.target_worker.release()
        self.draft_worker.release()
        if hasattr(self.pair.draft, "close"):  # a draft in its own process (engine/drafts/process.py)
            self.pair.draft.close()


def encode_prompt(tokenizer, prompt: str, chat: bool, history: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt: raw text, or one user turn (after `history`) in the tokenizer's chat template (what
    Engine.encode does, and the app's process on ZeroGPU, which holds the tokenizer but no model)."""
    if not prompt or not prompt.strip():
        raise SpecBranchError("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SpecBranchError(
                "chat mode needs a tokenizer with a chat template, and this one has none: use raw text"
            )
        messages = list(history or []) + [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
    else:
        ids = tokenizer.encode(prompt)
    return [int(i) for i in ids]


def check_prompt_length(prompt_ids: list[int], context_length: int) -> None:
    """Refuse an empty prompt, or one that leaves no room in the target's context for a new token."""
    if not prompt_ids:
        raise SpecBranchError("the prompt is empty")
    if len(prompt_ids) >= context_length:
        raise SpecBranchError(
            f"the prompt is {len(prompt_ids)} tokens; the model's context holds {context_length}, "
            f"with room for at least one new token"
        )


def compile_notice(draft) -> Notice | None:
    """While a draft's step is still to be compiled, or compiles in a process of its own (the app's --draft-forward
    lean-compiled), a run drafts with the eager step: the same output, slower drafting. Say so."""
    status = getattr(draft, "compile_status", None)
    if status is None or status()[0] not in ("waiting", "compiling"):
        return None
    return Notice(
        "info",
        "the draft's one-token step is still compiling in the background: this run drafts with "
        "the eager step (the same output, slower drafting)",
    )


def slow_draft_notice(events: list[Event]) -> Notice | None:
    """After a few forwards of each model: warn once if one draft step costs more than one target step. Medians of
    one-row draft steps and of the target's steps, so that a stall (the machine busy with something else for a
    moment) or a fork's k-row steps do not raise it: it claims that this pair cannot pay off."""
    spans = [e for e in events if isinstance(e, TimingSpan)]
    draft = [s.end - s.start for s in spans if s.worker == "draft" and s.kind == DRAFT]
    target = [s.end - s.start for s in spans if s.worker == "target" and s.kind in (DECODE, VERIFY)]
    if len(draft) < 3 or len(target) < 3:
        return None
    d, t = statistics.median(draft), statistics.median(target)
    if d <= t:
        return None
    return Notice(
        "warning",
        f"the draft is slower than the target ({1000 * d:.1f} ms vs {1000 * t:.1f} ms a "
        f"forward): speculation cannot pay off with this pair",
    )


def result_from_events(events: list[Event], tokenizer=None) -> Result:
    start = next(e for e in events if isinstance(e, RunStarted))
    finished = next((e for e in events if isinstance(e, Finished)), None)
    ids = [t for e in events if isinstance(e, TokensEmitted) for t in e.tokens]
    text = "".join(e.text for e in events if isinstance(e, TokensEmitted))
    metrics = finished.metrics if finished and finished.metrics else compute_metrics(events)
    return Result(start.method, ids, text, metrics, events, finished.reason if finished else "partial")
