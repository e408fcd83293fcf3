"""A ZeroGPU Space on this machine, for tests/test_zerogpu.py: the app as a Space runs it, with the real `spaces`
package (SPACES_ZERO_GPU=true: its fork, pickling and torch patching), where only the device API is a stand-in
(DeviceApi, an HTTP server on 127.0.0.1), and only the calls that need a CUDA build of torch or a GPU are stood in
for, each named below with why.

  python -m tests.zerogpu_space APP_ARGS...   runs app.py as a ZeroGPU Space would (SPACES_ZERO_DEVICE_API_URL set)

Every Engine built is logged to $ZEROGPU_TEST_LOG as "engine PID", so a test sees which process loaded the models."""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

ROOT = Path(__file__).resolve().parent.parent
LOG_ENV = "ZEROGPU_TEST_LOG"
_cpu_in_bad_fork = None  # a CPU-only torch's torch.cuda._is_in_bad_fork (cpu_build_stand_ins)


class DeviceApi:
    """ZeroGPU's device API, as the `spaces` client calls it (spaces/zero/api.py): /startup-report, /schedule (a GPU
    granted at once, `idle` when the last task was released: the worker may be reused), /allow (the worker's pid),
    /release. Every request is kept in `calls` as (path, query)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.granted = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                api.calls.append((url.path, query))
                body = api.answer(url.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, path: str) -> bytes:
        if path != "/schedule":
            return b"{}"
        idle = self.granted > 0 and self.count("/release") == self.granted
        self.granted += 1
        grant = {"idle": idle, "nvidiaIndex": 0, "nvidiaUUID": "GPU-stand-in", "allowToken": f"token-{self.granted}"}
        return json.dumps(grant).encode()

    def count(self, path: str) -> int:
        return sum(1 for p, _ in self.calls if p == path)

    def __enter__(self) -> DeviceApi:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def in_bad_fork() -> bool:
    """torch.cuda._is_in_bad_fork as a function pickle finds by name (a CPU-only build's is a lambda)."""
    return _cpu_in_bad_fork()


def cpu_build_stand_ins() -> None:
    """What the `spaces` package reads from a CUDA build of torch at import, which a CPU-only build lacks or has in
    another form: torch.version.cuda (spaces/zero/torch/static.py picks its fake memory statistics' layout by it),
    torch._C._cuda_init (spaces/zero/torch/patching.py keeps it, to put it back in the GPU worker), and
    torch.cuda._is_in_bad_fork, which spaces sends to a forked child pickled, and a CPU-only build's is a lambda (a
    CUDA build's is a builtin): in_bad_fork gives its answer. None of them starts CUDA: the app's process must
    never, and the worker's CUDA start is stood in for below."""
    global _cpu_in_bad_fork
    import torch

    torch.version.cuda = "12.8"
    _cpu_in_bad_fork, torch.cuda._is_in_bad_fork = torch.cuda._is_in_bad_fork, in_bad_fork

    def cuda_init():
        raise RuntimeError("CUDA init reached in a CPU-only torch")

    torch._C._cuda_init = cuda_init


def worker_stand_ins(zero_torch) -> None:
    """The two steps of the GPU worker's start (spaces/zero/wrappers.py worker_init) that need a GPU:
    - init(uuid) sets CUDA_VISIBLE_DEVICES to the granted GPU, then calls `torch.Tensor([0]).cuda()`, which starts
      CUDA there: the stand-in sets the variable and leaves CUDA alone (there is none);
    - move() moves the tensors packed at start to the GPU, then calls `torch.cuda.synchronize()`: the stand-in runs
      the real move (the app packs nothing: it loads no model in its own process) with that synchronize a no-op."""
    import torch

    def init(nvidia_uuid: str) -> None:
        os.environ["CUDA_VISIBLE_DEVICES"] = nvidia_uuid

    real_move = zero_torch.move

    def move(callback=None) -> None:
        synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *args: None
        try:
            real_move(callback=callback)
        finally:
            torch.cuda.synchronize = synchronize

    zero_torch.init, zero_torch.move = init, move


def log_engines() -> None:
    """Log each Engine built, with its process id (ZEROGPU_TEST_LOG)."""
    from engine import engine

    path, real = os.environ[LOG_ENV], engine.Engine.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        with open(path, "a") as f:
            f.write(f"engine {os.getpid()}\n")

    engine.Engine.__init__ = init


def main(argv: list[str]) -> None:
    cpu_build_stand_ins()
    import spaces  # noqa: F401 - first, as a Space imports it: it patches torch for this process
    import spaces.zero.torch as zero_torch

    worker_stand_ins(zero_torch)
    log_engines()
    sys.argv = [str(ROOT / "app.py"), *argv]
    runpy.run_path(str(ROOT / "app.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
