"""Workers: each model runs its forward passes on its own thread, so that (in the parallel methods)
draft and target compute at the same time. Every forward is timed as a TimingSpan.

On CPU a decode step is memory-bound: it runs as fast on 1 intra-op thread as on 2, so each worker
uses `threads` torch threads (default 1) and two workers really overlap on a 2-core machine. Its spans
are host clocks (perf_counter) around the call.

On CUDA each worker owns a stream on its model's device and runs every forward on it, so the two models'
kernels can overlap on one GPU. Nothing synchronises the whole device:
  - before a forward, the worker's stream waits on an event recorded on the caller's (event loop's) current
    stream, so whatever the loop queued first (cache crops, features handed over from the other model)
    is done before the forward reads it; tensors of the inputs and caches are `record_stream`ed on the
    worker's stream, so the allocator does not reuse their memory while the forward may still read it;
  - after it, the caller's stream waits on the forward's end event, and the output tensors are
    `record_stream`ed on the caller's stream.
Spans come from CUDA events on the worker's own stream (see `span_seconds`), so they say when the kernels
ran, not when Python launched them. The CUDA path has NOT been run on a GPU yet: it is written to the
documented semantics of torch.cuda streams and events and is tested on CPU only through `span_seconds`.
"""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import torch

from engine.config import SpecBranchError
from engine.events import TimingSpan


class OutOfMemory(SpecBranchError):
    """A forward ran out of device memory; the run it belonged to ends with this message."""


def _init_thread(threads: int) -> None:
    torch.set_num_threads(threads)


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
    elif (depth > 0 and (in_cache or hasattr(obj, "get_seq_length")) and hasattr(obj, "__dict__")
          and not isinstance(obj, torch.nn.Module)):
        for item in vars(obj).values():
            yield from _tensors(item, depth - 1, True)


def _record_on(obj, stream) -> None:
    """Tell the caching allocator that `stream` uses the CUDA tensors in obj (on the stream's device)."""
    for t in _tensors(obj):
        if t.is_cuda and t.device == stream.device:
            t.record_stream(stream)


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


class Measured(NamedTuple):
    """A forward's result with when it really computed (time.perf_counter seconds), where that differs from the
    call around it: a draft in its own process may compute a step before it is asked for (a step taken ahead), and
    its answer arrives at once. Worker.run times the span by these."""
    result: Any
    start: float
    end: float


class Worker:
    def __init__(self, name: str, threads: int = 1, device: torch.device | str | None = None,
                 solo_threads: int | None = None):
        """`device`: the device of the model this worker runs (None: CPU). On CUDA the worker owns a stream there.
        `solo_threads` (CPU): torch threads for a forward run with `solo=True`, one the other model waits on, so
        that it has the cores to itself (default: `threads`; Engine passes default_solo_threads())."""
        self.name = name
        self.threads = threads
        self.solo_threads = solo_threads or threads
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.stream = None
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.stream = torch.cuda.Stream(device=self.device)
        self._run_t0: float | None = None  # the run the reference event below belongs to
        self._ref = None  # CUDA: this run's reference event on the worker's stream
        self._anchor = 0.0  # ... and when it ran, in seconds since the run's t0
        self.closed = False  # shutdown() was called: no forward runs here again
        self._executor = PerProcess(lambda: ThreadPoolExecutor(1, thread_name_prefix=f"specbranch-{name}",
                                                               initializer=_init_thread, initargs=(threads,)))

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The worker's one thread (this process's: PerProcess)."""
        if self.closed:
            raise RuntimeError(f"the {self.name} worker is shut down")
        return self._executor.get()

    async def run(self, fn: Callable[..., Any], *args, kind: str, step: int, t0: float, tokens: int = 1,
                  solo: bool = False):
        """Run fn(*args) on this worker's thread; returns (result, TimingSpan). A forward that runs out of
        device memory frees the allocator's cache and raises OutOfMemory (a SpecBranchError). `solo`: the other
        model waits on this forward, so on a CPU it runs on solo_threads."""
        if self.stream is None:
            threads = self.solo_threads if solo else self.threads

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
            caller = torch.cuda.current_stream(self.device)
            ready = torch.cuda.Event()
            ready.record(caller)  # what the loop queued before this forward (e.g. features it handed over)

            def call():
                return self._cuda_forward(fn, args, ready, t0)

        def guarded():
            try:
                return call()
            except torch.cuda.OutOfMemoryError:
                pass
            # outside the except block: the error's traceback, and the tensors its frames held, are gone
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise OutOfMemory(f"out of memory on {self.device} in the {self.name} model's {kind} forward "
                              f"({tokens} token{'s' * (tokens != 1)}); the run was stopped. Try a shorter prompt, "
                              f"fewer new tokens, or a smaller pair")

        result, start, end, done = await asyncio.get_running_loop().run_in_executor(self.executor, guarded)
        if done is not None:
            caller.wait_event(done)  # the loop's later work on the result waits for the forward
            _record_on(result, caller)
        return result, TimingSpan(self.name, kind, step, start, end, tokens)

    def _cuda_forward(self, fn, args, ready, t0: float):
        """On the worker's thread: fn(*args) on the worker's stream, timed by events on that stream. Waits for
        this stream's work up to the forward's end event (not for the device)."""
        stream = self.stream
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
        end_ev.synchronize()  # this stream's work up to the end event, nothing else
        start, end = span_seconds(self._anchor, self._ref.elapsed_time(start_ev), self._ref.elapsed_time(end_ev))
        return result, start, end, end_ev

    def shutdown(self) -> None:
        if self._executor.made_here():
            self.executor.shutdown(wait=True)
        self.closed = True


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (faster hops between the workers and the event loop), else asyncio's."""
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()
