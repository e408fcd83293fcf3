"""The draft's process (engine/drafts/process.py): this module is its entry, `python -m engine.drafts.child`.

It loads the draft by the recipe the parent sends (models.loading.load_pair's arguments), keeps the draft's caches and
answers each forward with its logits. After each answer it takes the step the parent most likely asks for next
(step_ahead) while the parent reads the answer. The parent's side (RemoteLM, RemoteCache) never imports this module,
and this module imports the loader: the loader composes RemoteLM, and nothing imports back.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Client

import torch

from engine.drafts.board import AnswerBoard
from engine.kernels.vocab import argmax
from engine.models.loading import load_pair

LOW_PRIORITY = 19  # the nice value a compiled twin loads and compiles at (low_priority)


def serve(conn) -> None:
    """The child: load the draft by the recipe the parent sends first (models.load_pair's arguments; with `low`, at
    the lowest CPU priority: low_priority) and answer the parent until it closes the connection. An op that fails is
    reported with the next forward's answer."""
    torch.set_num_threads(1)
    lm, board = load_draft(conn)
    if lm is None:
        return
    conn.send(("ready", time.perf_counter()))  # its clock, which the parent checks it shares (RemoteLM.shares_clock)
    caches, failed, threads = {}, None, 1
    ahead = None  # (cache id, ids, logits, (start, end)): the step taken ahead on the tokens the last answer's draws
    # pick, fed to its cache, and when it computed
    while True:
        try:
            op, cid, arg = conn.recv()
        except (EOFError, OSError):
            return
        if ahead is not None:
            taken, ahead = ahead, None
            if op == "forward" and cid == taken[0] and arg[0] == taken[1] and failed is None:
                answer(conn, board, taken[2], True, taken[3])  # the step asked for is the one taken ahead: at once
                if arg[2]:
                    threads = on_threads(threads, arg[2])
                    ahead = step_ahead(lm, caches, cid, taken[2], arg[3], arg[4])
                continue
            caches[taken[0]].crop(-1)  # another request: undo the step taken ahead first
        try:
            if op == "forward":
                if failed is None:
                    ids, n, go_on, draws, sure, last_only = arg
                    threads = on_threads(threads, n)
                    logits, times = timed_forward(lm, ids, caches[cid], last_only)
                    answer(conn, board, logits, False, times)
                    if go_on:
                        threads = on_threads(threads, go_on)
                        ahead = step_ahead(lm, caches, cid, logits, draws, sure)
                    continue
            else:
                cache_op(conn, lm, caches, op, cid, arg)
        except Exception as exc:  # noqa: BLE001
            failed = failed or f"{type(exc).__name__}: {exc}"
        if op == "forward":
            conn.send(("error", failed, False, None, False))
            failed = None


def load_draft(conn) -> tuple[object | None, AnswerBoard | None]:
    """The draft, loaded by the recipe the parent sends first (with `low`, at the lowest CPU priority), and the answer
    board the parent made (its file descriptor, inherited, and size; None: answers go through the socket). The draft
    is None, with the reason sent to the parent, where it fails."""
    try:
        recipe, low, board = conn.recv()
        if board is not None:
            board = AnswerBoard(*board)
            board.close_file()

        def load():
            return load_pair(**recipe).draft

        return (low_priority(load) if low else load()), board
    except Exception as exc:  # noqa: BLE001 - any failure is the parent's message
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return None, None


def cache_op(conn, lm, caches: dict, op: str, cid, arg) -> None:
    """An op other than a forward: a cache made, freed, cropped, repeated or selected from, or the compile status
    sent back."""
    if op == "new":
        caches[cid] = lm.new_cache()
    elif op == "free":
        caches.pop(cid, None)
    elif op == "crop":
        caches[cid].crop(arg)
    elif op == "repeat":
        caches[cid].batch_repeat_interleave(arg)
    elif op == "select":
        caches[cid].batch_select_indices(torch.tensor(arg))
    elif op == "compile_status":
        conn.send(("status", *lm.compile_status()))


def timed_forward(lm, ids: list[list[int]], cache, last_only: bool = False) -> tuple[torch.Tensor, tuple[float, float]]:
    """The child's forward of `ids` [B, T] (logits [B, T, V], or [B, 1, V] with last_only: a prefill's), and when it
    computed (perf_counter seconds: start, end)."""
    start = time.perf_counter()
    logits = lm.forward(torch.tensor(ids, dtype=torch.long), cache, last_only=last_only).contiguous()
    return logits, (start, time.perf_counter())


def answer(conn, board: AnswerBoard | None, logits: torch.Tensor, taken_ahead: bool, times: tuple[float, float]):
    """A forward's answer: its shape, whether its step was taken ahead, when it computed and whether its logits are on
    the board (board.py); where they are not, their bytes follow."""
    on_board = board is not None and board.put(logits)
    conn.send(("ok", tuple(logits.shape), taken_ahead, times, on_board))
    if not on_board:
        conn.send_bytes(logits.view(-1).numpy())


def on_threads(current: int, n: int) -> int:
    """Run the child's next forward on n torch threads (set only when it changes); returns n."""
    if n != current:
        torch.set_num_threads(n)
    return n


def step_ahead(lm, caches: dict, cid: int, logits: torch.Tensor, draws: list | None, sure: float | None = None):
    """While the parent reads an answer, take the step it most likely asks for next: on the token each row's draw picks
    (sampling.NextDraw: the parent drew its uniform before asking; None: the argmax, as greedy drafting feeds). Its
    logits wait for a request with those ids; any other request (a fork, a hold, a rejection) undoes it first, after
    it finished. So where a row's largest probability is below `sure` (policy.Policy.sure_enough: the parent would
    most likely fork or hold there, and ask for another step at once) no step is taken: None."""
    rows = logits[:, -1]  # [B, V]
    if sure is not None and float(rows.softmax(-1).amax(-1).min()) < sure:
        return None
    ids = argmax(rows)[:, None].tolist() if draws is None else [[d.guess(r)] for d, r in zip(draws, rows)]  # [B, 1]
    return cid, ids, *timed_forward(lm, ids, caches[cid])


def low_priority(load):
    """load() run on a thread of its own at the lowest CPU priority (nice 19: on Linux a thread's own, inherited by
    the compiler processes it starts), and what it returns; the calling thread, which serves the forwards once it is
    loaded, keeps its priority. Why: a compiled twin (RemoteLM.start_compile) loads and compiles beside the draft's
    process that serves, and beside the target; on 2 cores at the same priority the runs meanwhile ran at 0.70-0.75x
    their speed, and at the lowest at 0.84-1.08x: it takes the cores when the app is idle (docs/models.md).
    Where a thread's priority cannot be set (not Linux), it loads at the usual one."""

    def run():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW_PRIORITY)
        except (AttributeError, OSError):
            pass
        return load()

    with ThreadPoolExecutor(1, thread_name_prefix="draft-load-low") as pool:  # its result, or its error, here
        return pool.submit(run).result()


def main() -> None:
    """The child's entry: connect to the parent at argv[1] with the key it put in the environment, and serve."""
    key = bytes.fromhex(os.environ.pop("SPECBRANCH_DRAFT_KEY"))
    serve(Client(sys.argv[1], "AF_UNIX", authkey=key))


if __name__ == "__main__":
    main()
