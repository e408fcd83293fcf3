"""Run one generation as a plain (sync) generator of events.

The engine is async; Gradio, and ZeroGPU's `spaces.GPU` in particular, want a sync generator that
yields CPU data. The generation runs on its own event loop in a thread and hands events over a
queue; closing this generator (the Stop button, a closed tab) stops the engine's stream cleanly."""
from __future__ import annotations

import queue
import threading
from typing import Iterator

from engine.events import Event
from engine.runtime import new_event_loop

_DONE = object()


def stream_events(engine, prompt_ids: list[int], cfg, prompt_text: str = "") -> Iterator[Event]:
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


try:  # on a ZeroGPU Space, GPU work must run inside spaces.GPU; elsewhere this is a no-op
    import spaces  # type: ignore

    stream_events = spaces.GPU(stream_events)  # noqa: F811
except ImportError:
    pass
