"""Rates over a sliding time window, for progress bars.

A batch job hands back results in bursts: several rows can finish in one call, a
microsecond apart. A rate measured from the last result (or from the first) then reads
thousands of prompts per second. `WindowRate` counts what was done in the last
``window`` seconds and divides by the time the window really spans, and reports nothing
until that span is long enough to mean something.
"""

from __future__ import annotations

import collections
import time


class WindowRate:
    """Amounts done per second over the last ``window`` seconds.

    Args:
      window: seconds of history the rates are taken over.
      min_span: the rates are None until the recorded history spans this many seconds.
      clock: the time source (seconds).
    """

    def __init__(self, window: float = 30.0, min_span: float = 2.0, clock=time.perf_counter):
        if not 0 < min_span <= window:
            raise ValueError(f"need 0 < min_span <= window, got {min_span} and {window}")
        self.window, self.min_span, self.clock = window, min_span, clock
        self.start = clock()
        self.events: collections.deque = collections.deque()  # (time, amounts)

    def add(self, **amounts: float) -> None:
        """Records ``amounts`` (e.g. ``prompts=1, tokens=57``) done now."""
        now = self.clock()
        self.events.append((now, amounts))
        while self.events and self.events[0][0] < now - self.window:
            self.events.popleft()
            self.start = self.events[0][0] if self.events else now

    def rate(self, name: str) -> float | None:
        """``name`` per second since the window's start, or None when it spans less
        than ``min_span`` seconds."""
        span = self.clock() - self.start
        if span < self.min_span:
            return None
        return sum(a.get(name, 0.0) for t, a in self.events if t > self.start) / span


__all__ = ["WindowRate"]
