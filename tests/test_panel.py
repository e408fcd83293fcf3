"""The few-rows panel kernel (engine/kernels/panel.py): its products against a float64 reference, a row's bits
independent of the rows beside it, HeadMatmul's routing through it, and what happens where it cannot be built."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import panel
from engine.kernels.lm_head import HeadMatmul

# this suite's machines are AVX2 CPUs, or Intel's or AMD's AVX-512 ones, with a C compiler: the kernel must be on there,
# not silently off
KIND = torch.backends.cpu.get_cpu_capability()
MEASURED_VENDOR = any(v in Path("/proc/cpuinfo").read_text() for v in ("GenuineIntel", "AuthenticAMD"))
ON_HERE = KIND == "AVX2" or (KIND == "AVX512" and MEASURED_VENDOR)


def test_the_kernel_builds_on_an_avx2_cpu_or_an_intel_or_amd_avx512_one():
    assert panel.available() == ON_HERE, panel.why_not()
    assert (panel.why_not() == "") == ON_HERE
    assert panel.serves_one_row() == (ON_HERE and KIND == "AVX512")


def test_both_builds_give_the_same_bits():
    """On an AVX-512 CPU both builds run: the AVX-512 one (4 or 2 panels side by side, and the panels past the last
    whole group one at a time) sums each output as the AVX2 one does, so a row's bits do not depend on the CPU's
    build either. N of 35 panels leaves 3 past the groups of 4 and 1 past the groups of 2."""
    if KIND != "AVX512":  # an AVX2 CPU cannot run the AVX-512 build (whoever made the CPU, the build runs here)
        return
    g = torch.Generator().manual_seed(2)
    narrow, wide = panel.entry("panel_matmul"), panel.entry("panel_matmul_avx512")
    for n, k in ((35 * 16, 57), (64, 576)):
        w = torch.randn(n, k, generator=g)
        panels = panel.pack(w)
        for rows in (1, 4, 6, 7, 12, 13):
            x = torch.randn(rows, k, generator=g)
            out = panel.matmul(x, panels, wide)
            assert torch.equal(out, panel.matmul(x, panels, narrow))
            assert (out.double() - x.double() @ w.double().t()).abs().max().item() < 1e-3


def test_products_match_a_float64_reference():
    """Every row count the kernel takes at once, and more (batches of 12), odd K, wide N: each product within float32
    rounding of the float64 product, and no closer to a wrong one (W's rows shifted by one panel column)."""
    if not ON_HERE:
        assert not panel.available()
        return
    g = torch.Generator().manual_seed(0)
    for n, k in ((32, 40), (96, 37), (1536, 576)):
        w = torch.randn(n, k, generator=g)
        panels = panel.pack(w)
        for rows in (1, 2, 3, 5, 6, 7, 9, 12, 13, 25):
            x = torch.randn(rows, k, generator=g)
            exact = x.double() @ w.double().t()
            out = panel.matmul(x, panels)
            assert out.shape == (rows, n) and out.dtype == torch.float32
            err = (out.double() - exact).abs().max().item()
            assert err < 1e-4 * (1 + exact.abs().max().item())
            shifted = x.double() @ w.roll(1, 0).double().t()
            assert (out.double() - shifted).abs().max().item() > 100 * err


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """A verify pass's row must give what the same row gives fed alone or with any others: one sum in order."""
    if not ON_HERE:
        return
    g = torch.Generator().manual_seed(1)
    w = torch.randn(192, 64, generator=g)
    panels = panel.pack(w)
    x = torch.randn(14, 64, generator=g)
    alone = torch.cat([panel.matmul(x[i : i + 1], panels) for i in range(14)])
    for rows in range(2, 15):
        assert torch.equal(panel.matmul(x[:rows], panels), alone[:rows])
    assert torch.equal(panel.matmul(x.flip(0), panels), alone.flip(0))


def test_head_matmul_takes_the_panels_for_up_to_twelve_rows(monkeypatch):
    """HeadMatmul routes 2-12 rows through the panels (seen: the kernel's function is called), and one row where the
    kernel serves it (AVX-512; then it keeps no one-row copy), and gives F.linear's product; 13+ rows, and one row on
    AVX2, take the other layouts."""
    if not ON_HERE:
        assert HeadMatmul(torch.randn(32, 16)).panels is None
        return
    w = torch.randn(64, 48)
    mm = HeadMatmul(w)
    assert mm.panels is not None
    calls = []
    real = panel.matmul
    monkeypatch.setattr(panel, "matmul", lambda flat, p: calls.append(flat.shape[0]) or real(flat, p))
    with torch.inference_mode():
        for rows in (1, 2, 4, 6, 7, 9, 12, 13):
            x = torch.randn(1, rows, 48)
            torch.testing.assert_close(mm(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    one = panel.serves_one_row()
    assert calls == [1] * one + [2, 4, 6, 7, 9, 12]
    assert (mm.wt is None) == one
    assert HeadMatmul(w, panels=False).panels is None
    assert HeadMatmul(torch.randn(40, 48)).panels is None  # 40 rows: no whole panels


def test_a_failed_build_says_why_and_leaves_the_library_kernels(tmp_path, monkeypatch):
    """Where the source does not compile, build() raises with the compiler's words; where the kernel is off,
    HeadMatmul keeps no panel copy and still gives the product."""
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    try:
        panel.build(bad, tmp_path / "out")
    except RuntimeError as exc:
        assert "failed" in str(exc) or "no C compiler" in str(exc)
    else:
        raise AssertionError("a source that is not C built")
    assert not list((tmp_path / "out").glob("*.so"))  # no half-written library left where a load would find it
    monkeypatch.setattr(panel, "_state", {"why": "RuntimeError: off for this test"})
    w = torch.randn(64, 48)
    mm = HeadMatmul(w)
    assert mm.panels is None and panel.why_not() == "RuntimeError: off for this test"
    x = torch.randn(3, 48)
    torch.testing.assert_close(mm(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
