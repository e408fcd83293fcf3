"""The draft in a process of its own (--draft-worker process): the draft's forwards run in a child process, asked
over a local socket.

Why: on the CPU every op of both forwards is dispatched from Python. As two threads of one process the models take
turns at the interpreter: a target step beside the draft costs 47-48 ms in a thread against 37-42 ms alone, and
37.5-41 ms beside the same draft in another process (docs/models.md). In the engine
the parallel methods' target pass beside the 4-bit self-draft takes 66-70 ms with the draft on a thread and 56-63 ms
with it here (docs/models.md).

How: the child (`python -m engine.drafts.child`, so nothing of the parent's __main__ runs there) loads the same
draft by the same recipe (models.with_draft's arguments) and keeps its caches. Here a RemoteLM stands in for the
draft: every attribute is the local draft's (its name, tokenizer, the model hf-assisted runs), but `forward` and
`new_cache` go to the child. A forward is answered with its logits, [B, T, V], as the local draft's forward returns
them (H-RAD's sampler reads every row of one pass; the engine's draft steps read the last row, and a prefill,
whose logits it never reads, asks for the last row alone: last_row): copied through shared memory where they fit
(board.py), else as raw bytes on the socket. A cache is mirrored by a RemoteCache that knows its length and rows,
so a rollback (crop), a fork (batch_repeat_interleave) and its collapse (batch_select_indices) are one message each,
answered by nothing: the socket keeps them in order before the next forward. A forward runs on as many torch
threads as the calling thread has (Worker.run sets them: its solo steps get the cores).
The engine fixes how it will pick each row's next token before it asks for the row (sampling.NextDraw: the argmax
when greedy; when sampling, the inverse CDF at a uniform it drew beforehand), so the child takes the step on that
token as soon as it has answered (step_ahead), while the engine reads the answer, samples and records; the next
request is then answered at once, and any other request undoes the step first. An answer is the same logits either
way, and the engine samples from its own probabilities: the child's pick is only a guess. An answer also says when the
child computed it, on its perf_counter, which the parent checks at start that it shares (shares_clock): a span is when
the draft computed, not when its answer was read (runtime.Measured); a step taken ahead and then undone is in no span.
At start the child's logits are checked bit for bit against the local draft's (RemoteLM.agrees); where the child
cannot load or disagrees, the draft stays in this process (in_process says why). Output is exact either way: q is
what the pass that drafted the token computed.
The engine asks for a step from its event loop's own thread and waits for the answer on the socket (RemoteStep,
RemoteLM.forward_on_loop), not through the draft worker's thread: no thread of this process is woken on the way.
A lean-compiled draft asked to compile later (the app) is compiled by a second child, which loads the draft and
compiles its step at the lowest CPU priority while the first serves eager; the first run to start once it is ready
takes it (RemoteLM.start_compile).
Only a CPU draft with a recipe runs here: a draft head reads the target's features, and on a GPU the workers'
streams overlap the models (engine/runtime.py).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path

import torch

from engine.config import SpecBranchError
from engine.drafts.board import BOARD_BYTES, AnswerBoard
from engine.models.cache import cropped_length
from engine.models.lean import compile_report
from engine.models.views import LastRow
from engine.runtime import Measured

START_TIMEOUT_S = 300  # loading the models in the child (a dequantized GGUF loads in seconds; a hub id may download)
COMPILE_TIMEOUT_S = (
    900  # loading them and compiling the draft's step (73 s cold for the self-draft beside runs, docs/models.md)
)


class RemoteCache:
    """A draft cache held in the child, seen from here: its length and rows, kept in step with what was sent."""

    def __init__(self, remote: RemoteLM, cid: int):
        self.remote, self.cid = remote, cid
        self.length, self.rows = 0, 1

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        self.length = cropped_length(self.length, n)
        self.remote.send("crop", self.cid, n)

    def batch_repeat_interleave(self, k: int) -> None:
        self.rows *= k
        self.remote.send("repeat", self.cid, k)

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        self.select_rows([int(i) for i in idx.tolist()])

    def select_row(self, row: int) -> None:
        """Keep row `row` alone (cache.select_row)."""
        self.select_rows([row])

    def select_rows(self, rows: list[int]) -> None:
        self.rows = len(rows)
        self.remote.send("select", self.cid, rows)


def _stop(conn, process) -> None:
    """Close the connection (the child ends at its end) and wait a moment for the child; at close or collection."""
    try:
        conn.close()
    except OSError:
        pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:  # still loading (a busy machine): it reads the closed connection only after
        process.kill()
        process.wait()  # reaped, so the child is gone when close returns


def _start(recipe: dict, low: bool = False, board: AnswerBoard | None = None):
    """Launch the child (`python -m engine.drafts.child`, so nothing of this process's __main__ runs there) and
    connect to it: (connection, process). The child finds this package as this process does; low: it loads the
    draft at the lowest CPU priority (low_priority); board: it inherits the answer board (board.py)."""
    key = secrets.token_bytes(32)
    with tempfile.TemporaryDirectory(prefix="specbranch-draft-") as folder:
        listener = Listener(str(Path(folder) / "socket"), "AF_UNIX", authkey=key)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(
            os.environ,
            SPECBRANCH_DRAFT_KEY=key.hex(),
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "engine.drafts.child", listener.address],
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=(board.fd,) if board is not None else (),
        )
        if board is not None:
            board.close_file()
        with ThreadPoolExecutor(1) as pool:
            accepted = pool.submit(listener.accept)
            while not accepted.done() and process.poll() is None:
                try:
                    accepted.result(timeout=0.2)
                except TimeoutError:
                    pass
            if not accepted.done():  # the child died first: a connection without the key ends the accept (closing
                with socket.socket(socket.AF_UNIX) as poke:  # the listener would not wake it on Linux)
                    poke.connect(listener.address)
            try:
                conn = accepted.result()
            except Exception:  # noqa: BLE001 - the poke fails the handshake
                conn = None
            listener.close()
    if conn is None:
        raise SpecBranchError(f"the draft's process ended before it connected (exit code {process.poll()})")
    conn.send((recipe, low, (board.fd, board.nbytes) if board is not None else None))
    return conn, process


class RemoteLM:
    """The draft `local`, with its forwards run by a child process that loaded it by `recipe` (low: at the lowest CPU
    priority, low_priority)."""

    def __init__(
        self, local, recipe: dict, timeout: float = START_TIMEOUT_S, low: bool = False, board_bytes: int = BOARD_BYTES
    ):
        self.local, self.recipe = local, recipe
        self._twin, self._twin_why, self._twin_thread, self._closed = None, "", None, False  # start_compile's
        self._child_status: tuple[str, str] | None = None  # the child's own compile_status, once asked
        started = time.perf_counter()
        self._board = AnswerBoard.create(board_bytes)  # None: every answer through the socket
        self._conn, self._process = _start(recipe, low, self._board)
        self._send_lock = threading.Lock()  # a message goes out whole, whichever thread sends it
        self._call_lock = threading.Lock()  # one forward in flight: its answer is the next one on the connection
        self._ids = itertools.count()
        self._freed: list[int] = []  # caches collected here, freed there with the next message
        self.steps_taken_ahead = 0  # forwards answered from a step the child had taken ahead (step_ahead)
        self.answers_on_board = 0  # forwards whose logits came through the board (board.py), not the socket
        self._stop = weakref.finalize(self, _stop, self._conn, self._process)
        if not self._conn.poll(timeout):
            self.close()
            raise SpecBranchError(f"the draft's process did not load the draft within {timeout:.0f} s")
        status, said = self._receive()
        if status != "ready":
            self.close()
            raise SpecBranchError(f"the draft's process could not load {local.name!r}: {said}")
        # the child's perf_counter read while this one waited: the same clock (Linux's is system-wide), so its
        # forwards' times can time the spans (forward(measured=True)); else the calls around them do
        self.shares_clock = started <= said <= time.perf_counter()

    def __getattr__(self, name):  # everything but the forward is the local draft's
        return getattr(self.__dict__["local"], name)

    def _ended(self) -> SpecBranchError:
        return SpecBranchError(
            f"the draft's process ended (exit code {self._process.poll()}); restart with --draft-worker thread"
        )

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._ended() from None

    def send(self, op: str, cid: int, arg=None) -> None:
        with self._send_lock:
            try:
                while self._freed:
                    self._conn.send(("free", self._freed.pop(), None))
                self._conn.send((op, cid, arg))
            except (OSError, ValueError):
                raise SpecBranchError("the draft's process is gone; restart with --draft-worker thread") from None

    def new_cache(self) -> RemoteCache:
        cache = RemoteCache(self, next(self._ids))
        self.send("new", cache.cid)
        weakref.finalize(cache, self._freed.append, cache.cid)  # list.append: safe wherever collection runs
        return cache

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: RemoteCache,
        hidden_states: bool = False,
        features: bool = False,
        ahead: int = 0,
        draws: list | None = None,
        measured: bool = False,
        sure: float | None = None,
        last_only: bool = False,
    ):
        """input_ids [B, T] -> logits [B, T, V] float32 ([B, 1, V] with last_only: the child runs the head on the last
        position alone, as models.LM.forward does), appending T positions to `cache`
        (the child runs the local draft's forward on the calling thread's torch thread count). ahead (torch threads; 0 =
        off): the next request will most likely feed the token each row's draw picks (`draws`, sampling.NextDraw, one
        a row; None: the argmax), so the child takes that step at once on that many threads, while this answer is read
        (step_ahead), unless a row's largest probability falls below `sure` (Policy.sure_enough: the engine would
        most likely fork or hold there); the answer to a request is the same whether its step was taken ahead or not.
        measured: return runtime.Measured(logits, when the child computed them) where it shares this clock
        (shares_clock)."""
        with self._call_lock:
            states, threads = hidden_states or features, torch.get_num_threads()
            self._ask(input_ids, cache, states, threads, ahead, draws, sure, last_only)
            return self._answer(input_ids, cache, measured)

    async def forward_on_loop(
        self,
        input_ids: torch.Tensor,
        cache: RemoteCache,
        hidden_states: bool = False,
        features: bool = False,
        *,
        threads: int,
        ahead: int = 0,
        draws: list | None = None,
        sure: float | None = None,
    ):
        """forward(..., measured=True) on `threads` torch threads, from the event loop's own thread: the request goes
        out at once and the loop waits for the answer on the socket (loop.add_reader), so no thread of this process
        is woken on the way: the hand-over to a worker's thread and back cost a draft step 0.10-0.16 ms more
        (docs/models.md). None, with nothing sent, where another thread's forward is in flight (an engine on another
        loop sharing this draft), or where the loop cannot watch a socket: the caller runs forward on its worker."""
        loop = asyncio.get_running_loop()
        try:
            fd = self._conn.fileno()
        except OSError:
            raise SpecBranchError("the draft's process is gone; restart with --draft-worker thread") from None
        if not self._call_lock.acquire(blocking=False):
            return None
        came = loop.create_future()
        try:
            loop.add_reader(fd, lambda: came.done() or came.set_result(None))
        except NotImplementedError:  # a loop that cannot watch a socket (Windows' proactor): the worker's thread
            self._call_lock.release()
            return None
        try:
            try:
                self._ask(input_ids, cache, hidden_states or features, threads, ahead, draws, sure)
                await came
            finally:
                loop.remove_reader(fd)
                os.set_blocking(fd, True)  # uvloop's reader made it non-blocking; _answer's reads wait for the rest
            return self._answer(input_ids, cache, True)
        except asyncio.CancelledError:  # the run was stopped: its answer is read, so the next forward reads its own
            self._answer(input_ids, cache, True)
            raise
        finally:
            self._call_lock.release()

    @property
    def last_row(self) -> LastRow:
        """This draft as a prefill sees it (models.LM.last_row): the child answers the last row's logits alone, so a
        long prompt's answer fits the board instead of [1, T, V] bytes through the socket (20 MB for 100 tokens)."""
        return LastRow(self)

    def _ask(self, input_ids, cache: RemoteCache, states: bool, threads: int, ahead, draws, sure, last_only=False):
        """Send a forward's request (under _call_lock: its answer is the next on the connection)."""
        if states:
            raise ValueError("a draft in its own process returns logits only")
        if input_ids.shape[0] != cache.rows:
            raise ValueError(f"the cache holds {cache.rows} rows, fed {input_ids.shape[0]}")
        self.send("forward", cache.cid, (input_ids.tolist(), threads, ahead, draws, sure, last_only))

    def _answer(self, input_ids, cache: RemoteCache, measured: bool):
        """Read the answer to the request _ask sent: logits [B, T, V] (runtime.Measured with measured, where the
        clock is shared)."""
        status, shape, taken_ahead, times, on_board = self._receive()
        if status != "ok":
            raise SpecBranchError(f"the draft's forward failed in its process: {shape}")
        self.steps_taken_ahead += taken_ahead
        self.answers_on_board += on_board
        if on_board:  # copied off before the next request, after which the child may write the board again
            logits = self._board.take(shape)
        else:
            logits = torch.empty(shape, dtype=torch.float32)
            try:
                self._conn.recv_bytes_into(logits.view(-1).numpy())  # 1-D: its len is its size
            except (EOFError, OSError):
                raise self._ended() from None
        cache.length += input_ids.shape[1]
        return Measured(logits, *times) if measured and self.shares_clock else logits

    def start_compile(self, on_done=None) -> None:
        """lean-compiled, asked for later (models.LM.start_compile): a new child loads the draft and compiles its step
        at load, in a process of its own, while this one's child serves with the eager step. On a thread of a serving
        process the compile would hold the interpreter that the draft's steps need: runs beside it ran at 0.25x `ar`
        (docs/models.md); in a process of its own it only shares the cores, and it loads and compiles at the
        lowest CPU priority (low_priority), so it takes them when the app is idle. The first run to start once it is
        ready takes it (take_compiled). on_done(message) says how it ended."""
        if self._twin_thread is not None or self.compile_status()[0] != "waiting":
            return
        if self.local.matmul == "bfloat16":  # refused at once (lean.LeanLlama.compile_step): no process to start
            self.local.start_compile()
            self._twin_why = self.local.compile_why
            if on_done is not None:
                on_done(self.local.compile_message())
        else:
            self._twin_thread = threading.Thread(
                target=self._compile_twin, args=(on_done,), daemon=True, name="draft-compile"
            )
            self._twin_thread.start()

    def _compile_twin(self, on_done) -> None:
        start, twin, why = time.perf_counter(), None, ""
        try:
            twin = RemoteLM(self.local, {**self.recipe, "compile_later": False}, COMPILE_TIMEOUT_S, low=True)
            state, why = twin.compile_status()
            if state != "compiled":
                why = why or f"the compile ended {state}"
            elif not twin.agrees(exact=False):
                why = "the compiled draft's process computed logits far from this one's"
        except SpecBranchError as exc:
            why = str(exc)
        if why or self._closed:
            if twin is not None:
                twin.close()
            self._twin_why = why or "the draft was closed"
        else:
            self._twin = twin
        if on_done is not None:
            on_done(
                compile_report(
                    self.local.name,
                    why,
                    f"one-token steps compiled in a process of its own "
                    f"({time.perf_counter() - start:.0f} s with loading); the next run takes it",
                )
            )

    def take_compiled(self) -> RemoteLM:
        """The compiled twin once it is ready (this one closed), else this one: call it between runs only, when no
        cache of this child is in use (Engine: as a run starts, under the engine's lock)."""
        twin, self._twin = self._twin, None
        if twin is None:
            return self
        self.close()
        return twin

    def compile_status(self) -> tuple[str, str]:
        """(state, why) as models.LM.compile_status has it, of the draft that runs the steps: "compiling" while a
        compiled twin is on its way (start_compile), else the child's own."""
        if self._twin is not None:
            return "compiled", ""
        if self._twin_why:
            return "eager", self._twin_why
        if self._twin_thread is not None:
            return "compiling", ""
        if self._child_status is None:  # asked once: a child compiles at load or never
            with self._call_lock:
                self.send("compile_status", 0)
                self._child_status = self._receive()[1:]
        return self._child_status

    def agrees(self, tokens: int = 24, seed: int = 0, exact: bool = True) -> bool:
        """Whether the child's draft gives the local draft's logits bit for bit (exact), or else the same model's: each
        row's distributions within 0.1 in total variation (a compiled step rounds otherwise than the eager one: 0.014
        on the self-draft's step, against 0.53 for the layer-skipping draft; docs/models.md). A prefill, a step,
        a rollback and a step on two rows (a fork), on random tokens."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, min(self.local.vocab_size, 1000), (1, tokens), generator=g)
        fork = torch.randint(0, min(self.local.vocab_size, 1000), (2, 1), generator=g)
        outputs = []
        for lm in (self.local, self):
            cache = lm.new_cache()
            out = [lm.forward(ids, cache)[:, -1], lm.forward(ids[:, :1], cache)[:, -1]]
            cache.crop(-1)
            cache.batch_repeat_interleave(2)
            out.append(lm.forward(fork, cache)[:, -1])
            outputs.append(out)
        same = torch.equal if exact else close_distributions
        return all(same(a, b) for a, b in zip(*outputs))

    def close(self) -> None:
        self._closed = True
        if self._twin is not None:
            self._twin.close()
        self._stop()


def close_distributions(a: torch.Tensor, b: torch.Tensor, tv: float = 0.1) -> bool:
    """Whether logits a and b [B, V] give distributions within `tv` in total variation, row by row."""
    return bool((0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1) <= tv).all())


def step_fn(lm, ahead: int, draws: list | None = None, sure: float | None = None):
    """lm.forward; for a draft in its own process a RemoteStep: timed by when the child computed (runtime.Measured),
    asking it to step ahead on `ahead` torch threads (0: not) on the tokens `draws` pick (None: the argmax), where its
    rows are at least `sure` (RemoteLM.forward), and run from the event loop where it can (Worker.run: on_loop)."""
    return RemoteStep(lm, ahead, draws, sure) if isinstance(lm, RemoteLM) else lm.forward


@dataclass(frozen=True)
class RemoteStep:
    """A forward of a draft in its own process, as a worker runs it: called on the worker's thread, or awaited on the
    event loop's (on_loop; None: the worker's thread it is)."""

    lm: RemoteLM
    ahead: int
    draws: list | None
    sure: float | None

    def __call__(self, input_ids: torch.Tensor, cache: RemoteCache, *states):
        return self.lm.forward(input_ids, cache, *states, ahead=self.ahead, draws=self.draws, measured=True,
                               sure=self.sure)  # fmt: skip

    async def on_loop(self, input_ids: torch.Tensor, cache: RemoteCache, *states, threads: int):
        return await self.lm.forward_on_loop(input_ids, cache, *states, threads=threads, ahead=self.ahead,
                                             draws=self.draws, sure=self.sure)  # fmt: skip


def fits(lm) -> str | None:
    """Why the draft `lm` cannot run in a process of its own, or None when it can."""
    if getattr(lm, "reads_target_features", False):
        return "a draft head reads the target's features in this process"
    if lm.device.type != "cpu":
        return f"a draft on {lm.device} overlaps the target on its own stream"
    return None


def in_process(lm, recipe: dict | None):
    """The draft `lm` with its forwards in a child process where it fits and the child computes its bits, else `lm`
    itself; and why not ("" when it runs there)."""
    why = "the draft was not loaded from a spec" if recipe is None else fits(lm)
    if why:
        return lm, why
    try:
        remote = RemoteLM(lm, recipe)
    except SpecBranchError as exc:
        return lm, str(exc)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the probe's passes on both sides on one thread, as the workers run them
    try:
        same = remote.agrees()
    finally:
        torch.set_num_threads(torch_threads)
    if not same:
        remote.close()
        return lm, "the draft's process computed other logits than this one"
    return remote, ""
