"""Workers: each model runs its forward passes on its own thread, so that (in the parallel methods)
draft and target compute at the same time. Every forward is timed as a TimingSpan.

On CPU a decode step is memory-bound: it runs as fast on 1 intra-op thread as on 2, so each worker
uses `threads` torch threads (default 1) and two workers really overlap on a 2-core machine.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from .events import TimingSpan


def _init_thread(threads: int) -> None:
    torch.set_num_threads(threads)


class Worker:
    def __init__(self, name: str, threads: int = 1):
        self.name = name
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"specbranch-{name}",
                                           initializer=_init_thread, initargs=(threads,))

    async def run(self, fn: Callable[..., Any], *args, kind: str, step: int, t0: float, tokens: int = 1):
        """Run fn(*args) on this worker's thread; returns (result, TimingSpan)."""
        def timed():
            start = time.perf_counter()
            result = fn(*args)
            if torch.cuda.is_available():  # host clocks only mean something once the GPU is done
                torch.cuda.synchronize()
            return result, start, time.perf_counter()

        result, start, end = await asyncio.get_running_loop().run_in_executor(self.executor, timed)
        return result, TimingSpan(self.name, kind, step, round(start - t0, 6), round(end - t0, 6), tokens)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (faster hops between the workers and the event loop), else asyncio's."""
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()
