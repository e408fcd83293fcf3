"""Workers: each model runs its forward passes on its own thread, so that (in the parallel methods)
draft and target compute at the same time. Every forward is timed as a TimingSpan.

On CPU a decode step is memory-bound: it runs as fast on 1 intra-op thread as on 2, so each worker
uses `threads` torch threads (default 1) and two workers really overlap on a 2-core machine. Its spans
are host clocks (perf_counter) around the call.

On CUDA each worker owns a stream on its model's device and runs every forward on it, so the two models'
kernels can overlap on one GPU. The stream is made at the worker's first forward, not when the worker is built: on
ZeroGPU the app's process may touch CUDA only inside its `spaces.GPU` function. Nothing synchronises the whole device:
  - before a forward, the worker's stream waits on an event recorded on the caller's (event loop's) current
    stream, so whatever the loop queued first (cache crops, features handed over from the other model)
    is done before the forward reads it; tensors of the inputs and caches are `record_stream`ed on the
    worker's stream, so the allocator does not reuse their memory while the forward may still read it; the
    inputs on the host are copied to page-locked memory first, so their copy to the device blocks no thread;
  - the worker's thread waits for the forward's end event, and only then does the caller's stream wait on it (a
    wait already met) and the output tensors get `record_stream`ed on the caller's stream. Had the caller's stream
    waited on an end still to come, the `ready` event of the other worker's next forward, recorded after that
    wait, would have held that forward behind this one: a draft step behind the target's verify pass, the overlap
    lost. The event loop itself never waits: it awaits the worker's thread.
Spans come from CUDA events on the worker's own stream (see `span_seconds`), so they say when the kernels
ran, not when Python launched them: a LateSpan whose times are read from its events when the span is read
(`settled`, which the decoders' step loop calls as it hands a step's events on). The CUDA path has NOT been run on a
GPU yet: it is written to the documented semantics of torch.cuda streams and events and is tested on CPU only against
fakes (tests/test_devices.py).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from engine.config import SpecBranchError
from engine.events import TimingSpan


class OutOfMemory(SpecBranchError):
    """A forward ran out of device memory; the run it belonged to ends with this message."""


def _init_thread(threads: int) -> None:
    torch.set_num_threads(threads)
    _sanitize_this_thread()


_sanitized: list[str] = []  # the worker threads the CUDA sanitizer checks (sanitized_threads)


def _sanitize_this_thread() -> None:
    """Under TORCH_CUDA_SANITIZER, have the sanitizer check this worker thread's kernels too: its dispatch mode is
    per thread, entered at import on the main thread only, and the forwards run on the workers' threads."""
    sanitizer = sys.modules.get("torch.cuda._sanitizer")
    if sanitizer is not None and sanitizer.cuda_sanitizer.enabled:
        sanitizer.cuda_sanitizer.dispatch.__enter__()
        _sanitized.append(threading.current_thread().name)


def sanitized_threads() -> list[str]:
    """The worker threads of this process that the CUDA sanitizer checks (gpu-check's sanitizer section)."""
    return list(_sanitized)


def default_solo_threads() -> int:
    """Torch threads for a draft step the target waits on: the cores this process may use, at most 2 (on the 2-core
    CPU a 4-bit draft step takes 11.6 ms on 2 threads against 15.5 on 1, docs/models.md; more is unmeasured)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def span_seconds(anchor_s: float, ref_to_start_ms: float, ref_to_end_ms: float) -> tuple[float, float]:
    """A span's (start, end) in seconds on the run's clock, from CUDA event times: `anchor_s` is when the
    run's reference event ran (seconds since the run's t0), the other two are `elapsed_time` from that
    reference to the forward's start and end events (milliseconds). The end is never before the start."""
    start = anchor_s + ref_to_start_ms / 1000.0
    end = anchor_s + max(ref_to_end_ms, ref_to_start_ms) / 1000.0
    return round(start, 6), round(end, 6)


def _tensors(obj, depth: int = 3, in_cache: bool = False):
    """The tensors in a forward's argument or result: tensors, sequences and dicts of them, and whatever a
    cache object holds (a DynamicCache's layers, a HeadCache's features); modules are left out."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth, in_cache)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth, in_cache)
    elif (
        depth > 0
        and (in_cache or hasattr(obj, "get_seq_length"))
        and hasattr(obj, "__dict__")
        and not isinstance(obj, torch.nn.Module)
    ):
        for item in vars(obj).values():
            yield from _tensors(item, depth - 1, True)


def _record_on(obj, stream) -> None:
    """Tell the caching allocator that `stream` uses the CUDA tensors in obj (on the stream's device)."""
    for t in _tensors(obj):
        if t.is_cuda and t.device == stream.device:
            t.record_stream(stream)


def _pinned(arg):
    """A CPU tensor in page-locked memory, from which a copy to the device (LM.forward's `to(non_blocking=True)`)
    is queued on the worker's stream without blocking its thread; anything else as it is."""
    if isinstance(arg, torch.Tensor) and arg.device.type == "cpu":
        return arg.pin_memory()
    return arg


class PerProcess:
    """A value made on first use, and made anew in a forked child. Threads do not survive a fork, nor do the locks
    they held: an executor whose thread the parent started would take work in the child and never run it. ZeroGPU
    runs each GPU call in a fork of the app's process (app/stream.py)."""

    def __init__(self, make: Callable[[], Any]):
        self._make, self._pid, self._value = make, None, None

    def get(self):
        if self._pid != os.getpid():
            self._value, self._pid = self._make(), os.getpid()
        return self._value

    def made_here(self) -> bool:
        """Whether this process made the value (and so may shut it down)."""
        return self._pid == os.getpid()


class LateSpan:
    """A CUDA forward's TimingSpan before its times are read: its start and end events, with the run's reference
    event and when that ran (`span_seconds`). `settle()` waits for the end event (work that is, by the time a
    step's events are handed on, already done) and reads the times."""

    __slots__ = ("worker", "kind", "step", "tokens", "start_ev", "end_ev", "ref", "anchor")

    def __init__(self, worker: str, kind: str, step: int, tokens: int, start_ev, end_ev, ref, anchor: float):
        self.worker, self.kind, self.step, self.tokens = worker, kind, step, tokens
        self.start_ev, self.end_ev, self.ref, self.anchor = start_ev, end_ev, ref, anchor

    def settle(self) -> TimingSpan:
        self.end_ev.synchronize()  # this stream's work up to the end event, nothing else
        start, end = span_seconds(self.anchor, self.ref.elapsed_time(self.start_ev), self.ref.elapsed_time(self.end_ev))
        return TimingSpan(self.worker, self.kind, self.step, start, end, self.tokens)


def settled(span: TimingSpan | LateSpan) -> TimingSpan:
    """The TimingSpan of a forward (a CPU worker's already is one; a CUDA worker's is read from its events now)."""
    return span.settle() if type(span) is LateSpan else span


def _done(job: asyncio.Future) -> bool:
    return job.done()


class Measured(NamedTuple):
    """A forward's result with when it really computed (time.perf_counter seconds), where that differs from the
    call around it: a draft in its own process may compute a step before it is asked for (a step taken ahead), and
    its answer arrives at once. Worker.run times the span by these."""

    result: Any
    start: float
    end: float


class Worker:
    def __init__(
        self, name: str, threads: int = 1, device: torch.device | str | None = None, solo_threads: int | None = None
    ):
        """`device`: the device of the model this worker runs (None: CPU). On CUDA the worker owns a stream there,
        made at its first forward (nothing here touches CUDA). `solo_threads` (CPU): torch threads for a forward run
        with `solo=True`, one the other model waits on, so that it has the cores to itself (default: `threads`;
        Engine passes default_solo_threads())."""
        self.name = name
        self.threads = threads
        self.solo_threads = solo_threads or threads
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"  # decided once: the CPU path below never looks at CUDA
        self._stream = PerProcess(self._new_stream)  # made on first use, and anew in a forked child
        self._run_t0: float | None = None  # the run the reference event below belongs to
        self._ref = None  # CUDA: this run's reference event on the worker's stream
        self._anchor = 0.0  # ... and when it ran, in seconds since the run's t0
        self._last_end = None  # CUDA: the end event of the last forward queued here
        # whether a job this worker runs has finished: on a CPU when its call returned; on CUDA when its kernels ran
        self.landed = self._landed_on_device if self.cuda else _done
        self.closed = False  # shutdown() was called: no forward runs here again
        self.users = 0  # the engines that share this worker (model_worker); the last to release() shuts it down
        self._executor = PerProcess(
            lambda: ThreadPoolExecutor(
                1, thread_name_prefix=f"specbranch-{name}", initializer=_init_thread, initargs=(threads,)
            )
        )

    def _new_stream(self):
        if self.device.index is None:  # `cuda`: the current GPU, by its canonical name
            self.device = torch.device("cuda", torch.cuda.current_device())
        return torch.cuda.Stream(device=self.device)

    @property
    def stream(self):
        """The worker's CUDA stream (made here on first use; None on a CPU)."""
        return self._stream.get() if self.cuda else None

    @stream.setter
    def stream(self, stream) -> None:
        """Run this worker's forwards on another's stream (gpu-check's shared-stream arrangement)."""
        self._stream = PerProcess(lambda: stream)

    def _landed_on_device(self, job: asyncio.Future) -> bool:
        return job.done() and (self._last_end is None or self._last_end.query())

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The worker's one thread (this process's: PerProcess)."""
        if self.closed:
            raise RuntimeError(f"the {self.name} worker is shut down")
        return self._executor.get()

    async def run(
        self, fn: Callable[..., Any], *args, kind: str, step: int, t0: float, tokens: int = 1, solo: bool = False
    ):
        """Run fn(*args) on this worker's thread; returns (result, TimingSpan). A forward that runs out of
        device memory frees the allocator's cache and raises OutOfMemory (a SpecBranchError). `solo`: the other
        model waits on this forward, so on a CPU it runs on solo_threads. A forward with an `on_loop` (a draft in its
        own process: drafts.process.RemoteStep) is awaited on the loop's thread instead, where it can be."""
        if not self.cuda:
            threads = self.solo_threads if solo else self.threads
            if hasattr(fn, "on_loop"):  # a draft in its own process, asked from this loop's thread
                done = await self._on_loop(fn, args, threads, (kind, step, t0, tokens))
                if done is not None:
                    return done

            def call():
                if threads != self.threads:  # the OpenMP team of this thread only; the other worker keeps its own
                    torch.set_num_threads(threads)
                try:
                    start = time.perf_counter()
                    result = fn(*args)
                    end = time.perf_counter()
                    if isinstance(result, Measured):  # when it computed, not when it was asked for
                        result, start, end = result
                    return result, round(start - t0, 6), round(end - t0, 6), None
                finally:
                    if threads != self.threads:
                        torch.set_num_threads(self.threads)
        else:
            stream = self.stream  # first: making it names the device, where it was `cuda`
            caller = torch.cuda.current_stream(self.device)
            ready = torch.cuda.Event()
            ready.record(caller)  # what the loop queued before this forward (e.g. features it handed over)
            args = tuple(_pinned(a) for a in args)  # the ids' copy to the device then blocks no thread

            def call():
                return self._cuda_forward(stream, fn, args, ready, t0, (kind, step, tokens))

        def guarded():
            try:
                return call()
            except torch.cuda.OutOfMemoryError:
                pass
            # outside the except block: the error's traceback, and the tensors its frames held, are gone
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise OutOfMemory(
                f"out of memory on {self.device} in the {self.name} model's {kind} forward "
                f"({tokens} token{'s' * (tokens != 1)}); the run was stopped. Try a shorter prompt, "
                f"fewer new tokens, or a smaller pair"
            )

        result, start, end, done = await asyncio.get_running_loop().run_in_executor(self.executor, guarded)
        if done is None:
            return result, TimingSpan(self.name, kind, step, start, end, tokens)
        caller.wait_event(done.end_ev)  # the loop's later work on the result waits for the forward (which has run)
        _record_on(result, caller)
        return result, done

    async def _on_loop(self, fn, args: tuple, threads: int, what: tuple[str, int, float, int]):
        """fn.on_loop(*args) awaited on the loop's thread: (result, TimingSpan), timed by when it computed where it
        says (runtime.Measured), else by the call around it; None where it cannot run there (run: the thread then)."""
        kind, step, t0, tokens = what
        asked = time.perf_counter()
        result = await fn.on_loop(*args, threads=threads)
        if result is None:
            return None
        if not isinstance(result, Measured):  # the child's clock is not this one: the call around it
            result = Measured(result, asked, time.perf_counter())
        start, end = round(result.start - t0, 6), round(result.end - t0, 6)
        return result.result, TimingSpan(self.name, kind, step, start, end, tokens)

    def _cuda_forward(self, stream, fn, args, ready, t0: float, what: tuple[str, int, int]):
        """On the worker's thread: fn(*args) queued on the worker's stream between two timing events; returns
        without waiting for it, with a LateSpan of those events."""
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if self._run_t0 != t0:  # a new run: a reference event, taken with the stream idle
                stream.synchronize()
                before = time.perf_counter()
                self._ref = torch.cuda.Event(enable_timing=True)
                self._ref.record(stream)
                self._ref.synchronize()
                self._anchor = (before + time.perf_counter()) / 2 - t0
                self._run_t0 = t0
            stream.wait_event(ready)
            _record_on(args, stream)
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record(stream)
            result = fn(*args)
            end_ev.record(stream)
        self._last_end = end_ev
        # this thread waits for the forward to run before the loop hears of it: the loop's stream waits on the end
        # event only then (run), so it never holds the other worker's next forward behind this one (the `ready`
        # event the other records is on the loop's stream); the loop itself never waits
        end_ev.synchronize()
        return result, None, None, LateSpan(self.name, *what, start_ev, end_ev, self._ref, self._anchor)

    async def timed(self, fn: Callable[..., Any], *args, kind: str) -> TimingSpan:
        """Run fn(*args) as a forward of this worker (run) and return its span, read at once: on CUDA on the worker's
        thread, where waiting for the end event holds up neither the event loop nor the other worker."""
        _, span = await self.run(fn, *args, kind=kind, step=0, t0=0.0)
        if type(span) is LateSpan:
            span = await asyncio.get_running_loop().run_in_executor(self.executor, span.settle)
        return span

    def shutdown(self) -> None:
        if self._executor.made_here():
            self.executor.shutdown(wait=True)
        self.closed = True

    def release(self) -> None:
        """One engine is done with this shared worker (model_worker); the last one shuts it down."""
        with _shared_lock:
            self.users -= 1
            last = self.users <= 0
        if last:
            self.shutdown()


_shared: dict[tuple, Worker] = {}  # model_worker's workers, by the model's id and the thread counts
_shared_lock = threading.Lock()


def model_worker(name: str, model, threads: int = 1, solo_threads: int | None = None) -> Worker:
    """The worker that runs `model`'s forwards (an LM; None: a worker of its own, for no model): one per model object
    and thread counts in this process, shared by every Engine on it, so that each model's steps run on one thread,
    the one that compiled them (CUDA graph trees keep their state per thread: LM.compile_here), also where several
    engines share a target (the app's drafts, the bench's). Each Engine release()s it when it closes."""
    if model is None:
        return Worker(name, threads, None, solo_threads)
    key = (id(model), name, threads, solo_threads)
    with _shared_lock:
        worker = _shared.get(key)
        if worker is None or worker.closed:
            worker = _shared[key] = Worker(name, threads, model.device, solo_threads)
            weakref.finalize(model, _shared.pop, key, None)  # the id may be another model's once this one is gone
        worker.users += 1
    return worker


def run_apart(make_coroutine: Callable[[], Any]):
    """Run a coroutine to its end from synchronous code, also where an event loop already runs on this thread (an
    Engine measures its branch costs from inside a run): on a new event loop, on a thread of its own."""

    def run():
        loop = new_event_loop()
        try:
            return loop.run_until_complete(make_coroutine())
        finally:
            loop.close()

    with ThreadPoolExecutor(1, thread_name_prefix="specbranch-apart") as pool:
        return pool.submit(run).result()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (faster hops between the workers and the event loop), else asyncio's."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()
