"""Run one generation as a plain (sync) generator of events: here, or on a ZeroGPU Space inside `spaces.GPU`.

The engine is async; Gradio, and ZeroGPU's `spaces.GPU` in particular, want a sync generator that yields CPU data.
The generation runs on its own event loop in a thread and hands events over a queue; closing this generator (the
Stop button, a closed tab) stops the engine's stream cleanly.

On a ZeroGPU Space CUDA exists only inside a function decorated with `spaces.GPU`. The `spaces` package runs it in a
forked worker process, which it keeps for later calls while it is idle, and sends it each call's arguments pickled;
each yielded item comes back pickled too. So the GPU function here (gpu_run) takes only plain values (the draft's
spec, the prompt's token ids, the GenerationConfig, the prompt's text) and builds the draft's Engine inside the
worker on its first call, from the engine cache that serve_on_gpu names (PerProcess: one made in each process, so
never the app's own); a later call to the same worker reuses it. The app's process holds no model (app.engines
GpuFront) and touches no CUDA. Events are frozen dataclasses of CPU values, so they cross unchanged; an error raised
in the worker crosses as a GpuError record and is raised again here with its message (spaces would hand the app only
the exception's class name). The GPU is held at most `duration` seconds a call, computed per request from the tokens
asked for (gpu_seconds)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.config import GenerationConfig, SpecBranchError
from engine.events import Event
from engine.runtime import PerProcess, new_event_loop

from .engines import GpuFront

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


@dataclass(frozen=True)
class GpuError:
    """An error raised in the GPU worker, as it crosses back: its message, and whether it was a SpecBranchError (a
    message for the visitor: a prompt too long, out of memory) or something else."""

    message: str
    ours: bool

    def error(self) -> Exception:
        return SpecBranchError(self.message) if self.ours else RuntimeError(self.message)


_gpu_engines: PerProcess | None = None  # the GPU worker's engine cache (serve_on_gpu)


def serve_on_gpu(make_cache: Callable) -> None:
    """Name how the GPU worker gets its engines: make_cache() -> an EngineCache (app/engines.py) whose get(draft)
    loads a draft's Engine on the worker's GPU. Called at start, before the first request: the worker is a fork of
    this process and finds it there."""
    global _gpu_engines
    _gpu_engines = PerProcess(make_cache)


def gpu_run(draft: str, prompt_ids: list[int], cfg: GenerationConfig, prompt_text: str = "") -> Iterator[Event]:
    """The GPU function: one generation on the draft's Engine, loaded in this (worker) process on first use."""
    try:
        if _gpu_engines is None:
            raise RuntimeError("no engines to run on the GPU: serve_on_gpu was not called at start")
        engine = _gpu_engines.get().get(draft)
        yield from run_events(engine, prompt_ids, cfg, prompt_text)
    except Exception as exc:  # noqa: BLE001 - crosses back whole (GpuError), whatever it is
        yield GpuError(str(exc) or type(exc).__name__, isinstance(exc, SpecBranchError))


def gpu_seconds(draft: str, prompt_ids: list[int], cfg: GenerationConfig, prompt_text: str = "") -> int:
    """The GPU time one request may hold on ZeroGPU (spaces.GPU's `duration`, called with gpu_run's arguments):
    a fixed start plus a share per token asked for, at most MAX_GPU_S."""
    return int(min(MAX_GPU_S, BASE_GPU_S + GPU_S_PER_TOKEN * cfg.max_new_tokens))


def on_zerogpu(fn, spaces_module):
    """fn inside spaces.GPU with a duration computed per request; fn itself where there is no `spaces` package (and
    spaces.GPU gives fn back unchanged off ZeroGPU)."""
    if spaces_module is None:
        return fn
    return spaces_module.GPU(duration=gpu_seconds)(fn)


def spaces_module():
    """The `spaces` package of a Hugging Face Space, or None where it is not installed."""
    try:
        import spaces  # type: ignore
    except ImportError:
        return None
    return spaces


def zerogpu(spaces_module) -> bool:
    """Whether this process serves a ZeroGPU Space (the `spaces` package, with SPACES_ZERO_GPU set)."""
    return spaces_module is not None and bool(spaces_module.config.Config.zero_gpu)


on_gpu = on_zerogpu(gpu_run, spaces_module())


def stream_events(engine, prompt_ids: list[int], cfg: GenerationConfig, prompt_text: str = "") -> Iterator[Event]:
    """One generation's events, for the tabs: on an Engine here, or for a GpuFront through the GPU function."""
    if not isinstance(engine, GpuFront):
        yield from run_events(engine, prompt_ids, cfg, prompt_text)
        return
    for item in on_gpu(engine.draft, list(prompt_ids), cfg, prompt_text):
        if isinstance(item, GpuError):
            raise item.error()
        yield item
