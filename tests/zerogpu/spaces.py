"""A stand-in for Hugging Face's `spaces` package, as ZeroGPU runs a decorated function: in a forked process, each
yielded item pickled back to the caller, an exception raised there raised here, and `duration` called with the
function's own arguments. GPU(...) records each call's duration in CALLS."""

from __future__ import annotations

import functools
import multiprocessing

CALLS: list[int] = []
ANSWER_S = 120


def _child(fn, args, kwargs, conn) -> None:
    try:
        for item in fn(*args, **kwargs):
            conn.send(("item", item))
    except BaseException as exc:  # noqa: BLE001 - handed back as ZeroGPU does
        conn.send(("error", exc))
    finally:
        conn.send(("done", None))
        conn.close()


def GPU(fn=None, *, duration=60):
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            CALLS.append(duration(*args, **kwargs) if callable(duration) else duration)
            ctx = multiprocessing.get_context("fork")
            here, there = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_child, args=(fn, args, kwargs, there), daemon=True)
            process.start()
            there.close()
            try:
                while True:
                    if not here.poll(ANSWER_S):  # a child that hangs fails the caller instead of hanging it
                        raise TimeoutError(f"the GPU function sent nothing for {ANSWER_S} s")
                    kind, item = here.recv()
                    if kind == "item":
                        yield item
                    elif kind == "error":
                        raise item
                    else:
                        return
            finally:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()

        return wrapper

    return decorate if fn is None else decorate(fn)
