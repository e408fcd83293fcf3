"""Run one generation as a plain (sync) generator of events, on a ZeroGPU Space inside `spaces.GPU`.

The engine is async; Gradio, and ZeroGPU's `spaces.GPU` in particular, want a sync generator that yields CPU data.
The generation runs on its own event loop in a thread and hands events over a queue; closing this generator (the
Stop button, a closed tab) stops the engine's stream cleanly.

On a ZeroGPU Space (the `spaces` package is importable) CUDA exists only inside a function decorated with
`spaces.GPU`, which runs it in a forked process and sends each yielded event back pickled: events are plain frozen
dataclasses of CPU values, so they cross unchanged. The GPU is held at most `duration` seconds a call, computed per
request from the tokens asked for (gpu_seconds)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from engine.events import Event
from engine.runtime import new_event_loop

_DONE = object()
BASE_GPU_S = 20  # moving the models onto the GPU the call was given, the prefill and the first steps
GPU_S_PER_TOKEN = 0.06  # a decode step of the embedded pair on a GPU is a few ms; kept wide for a slow or busy GPU
MAX_GPU_S = 300  # what one ZeroGPU call may ask for


def run_events(engine, prompt_ids: list[int], cfg, prompt_text: str = "") -> Iterator[Event]:
    items: queue.Queue = queue.Queue()
    stop = threading.Event()

    def run() -> None:
        loop = new_event_loop()

        async def consume():
            agen = engine.generate(prompt_ids, cfg, prompt_text)
            try:
                async for event in agen:
                    items.put(event)
                    if stop.is_set():
                        break
            finally:
                await agen.aclose()

        try:
            loop.run_until_complete(consume())
        except BaseException as exc:  # handed to the consumer, which shows it
            items.put(exc)
        finally:
            loop.close()
            items.put(_DONE)

    thread = threading.Thread(target=run, daemon=True, name="specbranch-stream")
    thread.start()
    try:
        while (item := items.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def gpu_seconds(engine, prompt_ids: list[int], cfg, prompt_text: str = "") -> int:
    """The GPU time one request may hold on ZeroGPU (spaces.GPU's `duration`, called with run_events' arguments):
    a fixed start plus a share per token asked for, at most MAX_GPU_S."""
    return int(min(MAX_GPU_S, BASE_GPU_S + GPU_S_PER_TOKEN * cfg.max_new_tokens))


def on_zerogpu(fn, spaces_module):
    """fn inside spaces.GPU with a duration computed per request; fn itself where there is no `spaces` module."""
    if spaces_module is None:
        return fn
    return spaces_module.GPU(duration=gpu_seconds)(fn)


def spaces_module():
    """The `spaces` package of a Hugging Face Space, or None elsewhere."""
    try:
        import spaces  # type: ignore
    except ImportError:
        return None
    return spaces


stream_events = on_zerogpu(run_events, spaces_module())
