"""Text for people: byte sizes, the machine line and plain-text tables, shared by the CLI, the benchmarks and
the harnesses (a leaf: imports no other detrl module)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def format_bytes(n: float) -> str:
    """``1234567`` -> ``'1.2 MB'`` (decimal units)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def machine_line(threads: int) -> str:
    """One line naming the CPU, core count, torch and python versions and the thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (
        f"machine: {cpu} | {os.cpu_count()} cores | torch {torch.__version__} | "
        f"{threads} thread{'s' if threads != 1 else ''} | python {platform.python_version()}"
    )


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, a dashed rule under the
    header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)
