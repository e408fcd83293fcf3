"""What the processor is, as Linux names it (/proc/cpuinfo): the kernels' choices and the bench's machine record read
it, since two machines with the same kernel image and torch can still differ in what a several-row matmul costs
against a one-row one (docs/models.md "Few-row matmuls on an AVX-512 CPU")."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def field(key: str) -> str | None:
    """The first processor's value for `key` in /proc/cpuinfo ("model name", "vendor_id"), or None where there is
    no such file or field."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def name() -> str:
    """The processor's model, else the platform's name for it."""
    return field("model name") or platform.processor() or platform.machine() or "unknown"
