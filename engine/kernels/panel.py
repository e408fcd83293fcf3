"""A float32 matmul for a few rows that streams the weights once: panel.c, built with the system's C compiler on
first use and called through ctypes (which lets go of the GIL for the call, so the two models' workers still
compute at once).

Why a kernel of our own: a target pass is bound by streaming its weights from memory, so a pass over a few tokens
should cost about what one token does. The library kernels do not get there. On an AVX2 CPU MKL's x @ Wᵀ costs
1.5-2.5x one row for 2-4 rows, and oneDNN's packed weight (lm_head.packed_weight) about 1.8x one row already at 2.
On the AVX-512 CPU of the later runs (an Intel Xeon with AMX) the packed weight costs about what one row does for
1-6 rows, but 1.3x MKL's one-row product, so a pass over 4 tokens cost 1.3x a one-token step. panel.c reads each
weight from memory once for up to 12 rows, in 16-column panels laid out as the loop reads them; its AVX-512 build
streams several panels side by side, which there costs less than MKL's one row even for one row, so on an AVX-512
CPU it serves one row too (serves_one_row()); so it does on the AMD EPYC with AVX-512 of other runs, where it costs
0.68x MKL's one row. docs/models.md "Few-row matmuls" has the figures. It runs on AVX2 CPUs and on Intel's and AMD's
AVX-512 ones (available(), build_here()); it was measured on no other.

Each output is one float32 sum over k in order, whatever the number of rows and in either build: a row's bits do
not depend on the rows fed beside it (tests/test_panel.py). Against the library's kernels they differ by float
rounding, as the library's kernels already differ among themselves.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine.kernels import cpu

SOURCE = Path(__file__).with_name("panel.c")
PANEL = 16  # columns a panel holds: a row's accumulators, two 8-float registers (AVX2) or one 16-float (AVX-512)
MAX_ROWS = 12  # rows one pass over the weights takes: MAX_ROWS in panel.c (more go 12 at a time)
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
# torch.backends.cpu.get_cpu_capability() values where the kernel beats the library's, and the build each calls
ENTRY = {"AVX2": "panel_matmul", "AVX512": "panel_matmul_avx512"}
ONE_ROW_KINDS = ("AVX512",)  # where it beats MKL's one-row x @ Wᵀ as well (docs/models.md)
# AVX-512 CPUs of these vendors only (/proc/cpuinfo's vendor_id): the AVX-512 build was measured on an Intel Xeon and an
# AMD EPYC, and cost no more than the library's kernels for 1-12 rows on either (docs/models.md)
AVX512_VENDORS = ("GenuineIntel", "AuthenticAMD")


def build_here() -> str:
    """The build (an ENTRY value) this CPU runs; RuntimeError saying why where it runs none."""
    kind = torch.backends.cpu.get_cpu_capability()
    if kind not in ENTRY:
        raise RuntimeError(f"CPU capability {kind}, not AVX2 or AVX512")
    vendor = cpu.field("vendor_id")
    if kind == "AVX512" and vendor not in AVX512_VENDORS:
        raise RuntimeError(f"an AVX-512 CPU of {vendor or 'an unnamed vendor'}: measured on {AVX512_VENDORS} only")
    return ENTRY[kind]


_lock = threading.Lock()
_state: dict = {}  # "fn": the loaded function, or "why": why there is none


def cache_dir() -> Path:
    """Where the built library is kept between runs: the user's cache (XDG_CACHE_HOME, else ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "specbranch"


def build(source: Path = SOURCE, out_dir: Path | None = None) -> Path:
    """Compile `source` into a shared library named by its content's hash (so an edit builds anew); returns its path.
    Built under a temporary name and renamed into place, so processes building at once never load half a file.
    Raises RuntimeError with the compiler's message where it fails."""
    text = source.read_bytes()
    out_dir = out_dir or cache_dir()
    target = out_dir / f"panel-{hashlib.sha256(text + ' '.join(FLAGS).encode()).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:300]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def entry(name: str):
    """One of the built library's matmuls (an ENTRY value) as a ctypes function: (x, panels, out, M, K, N)."""
    fn = getattr(ctypes.CDLL(str(build())), name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return fn


def _load():
    """The kernel's function, built and loaded once a process; None where it cannot run here (_state["why"])."""
    if _state:  # settled: every matmul after the first reads it without the lock
        return _state.get("fn")
    with _lock:
        if not _state:
            try:
                _state["fn"] = entry(build_here())
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _state["why"] = f"{type(exc).__name__}: {exc}"[:300]
        return _state.get("fn")


def available() -> bool:
    """The kernel runs on this machine (built, loaded, an AVX2 CPU or an AVX-512 one of AVX512_VENDORS)."""
    return _load() is not None


def serves_one_row() -> bool:
    """The kernel also takes a one-row product here (a decode step), where it beats MKL's x @ Wᵀ."""
    return available() and torch.backends.cpu.get_cpu_capability() in ONE_ROW_KINDS


def why_not() -> str:
    """Why the kernel is off here ("" where it is on)."""
    _load()
    return _state.get("why", "")


def fits(weight: torch.Tensor) -> bool:
    """A float32 CPU weight [N, K] with N a multiple of PANEL."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.shape[0] % PANEL == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> panels [N / PANEL, K, PANEL]: a copy, each panel's K rows of 16 columns contiguous."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def matmul(flat: torch.Tensor, panels: torch.Tensor, fn=None) -> torch.Tensor:
    """flat [R, K] float32 @ Wᵀ -> [R, N], with W's panels from pack(); through this CPU's build, or `fn` (entry())."""
    fn = fn or _load()
    flat = flat.to(torch.float32).contiguous()  # the kernel reads raw float32 rows
    rows, k = flat.shape
    n = panels.shape[0] * PANEL
    if panels.shape[1] != k:
        raise ValueError(f"input of {k} features for a weight of {panels.shape[1]}")
    out = torch.empty(rows, n, dtype=torch.float32)
    fn(flat.data_ptr(), panels.data_ptr(), out.data_ptr(), rows, k, n)
    return out
