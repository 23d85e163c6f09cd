"""What every section of ``fed-dp benchmark`` measures with: timing, medians, torch threads, tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def summarize(values: list[float]) -> dict[str, float]:
    """Median, min, max and the count of a list of measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op torch threads (None: leave as is)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
