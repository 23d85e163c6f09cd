"""Round progress of a simulation: a tqdm bar on a terminal, plain lines anywhere else.

A progress bar redraws itself with carriage returns; written to a log file it becomes one line of thousands of
``\\r``. When the stream is not a terminal (``stream.isatty()`` is false) :class:`RoundProgress` prints instead
one plain line after round r when r is a multiple of ``every_rounds``, when ``every_seconds`` have passed since
the last line, and after the last round:

    rounds 20/200: epsilon 1.2345, train loss 0.4567

The loss shown is the users' mean local training loss of the round (``nonprivate_train_loss``): a simulation's
own diagnostic, never published.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm


def _epsilon(value: Any) -> str:
    return value if isinstance(value, str) else f"{value:.4f}"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


class RoundProgress:
    """Progress over ``total`` rounds on ``stream`` (default ``sys.stderr``): :meth:`update` after each round's
    record, :meth:`close` at the end. ``every_rounds`` / ``every_seconds``: when a plain line is due (not a
    terminal only); ``clock``: the time source of ``every_seconds`` (``time.monotonic``)."""

    def __init__(self, total: int, desc: str = "rounds", *, stream: TextIO | None = None, leave: bool = False,
                 every_rounds: int | None = None, every_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be an integer >= 1 (the planned rounds), got {total!r}")
        if every_rounds is not None and (isinstance(every_rounds, bool) or not isinstance(every_rounds, int)
                                         or every_rounds < 1):
            raise ValueError(f"every_rounds must be an integer >= 1 or None (a tenth of the rounds), got {every_rounds!r}")
        self.total, self.desc = total, desc.strip()
        self.stream = sys.stderr if stream is None else stream
        self.every_rounds = every_rounds if every_rounds is not None else max(1, total // 10)
        self.every_seconds, self.clock = every_seconds, clock
        self.done = 0
        self._last_line = clock()
        self._bar = tqdm(total=total, desc=desc, leave=leave, file=self.stream) if _is_terminal(self.stream) else None

    def update(self, record: dict[str, Any]) -> None:
        """One more round released (``record``: its record, with ``epsilon`` and, in simulations,
        ``nonprivate_train_loss``)."""
        self.done += 1
        loss = record.get("nonprivate_train_loss", math.nan)
        if self._bar is not None:
            self._bar.set_postfix(eps=_epsilon(record["epsilon"]), loss=f"{loss:.3f}")
            self._bar.update(1)
            return
        now = self.clock()
        if self.done % self.every_rounds == 0 or self.done == self.total or now - self._last_line >= self.every_seconds:
            self._last_line = now
            print(f"{self.desc} {self.done}/{self.total}: epsilon {_epsilon(record['epsilon'])}, train loss {loss:.4f}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
