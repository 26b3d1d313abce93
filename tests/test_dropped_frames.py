"""Dropped frames cost their reader a count each and at most one log line per interval."""

from __future__ import annotations

import logging

from common.dropped_frames import DroppedFrames
from common.service.throughput import Throughput


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_every_drop_is_counted_and_the_log_hears_of_one_per_interval(caplog):
    clock, counted = Clock(), []
    dropped = DroppedFrames(
        "handoff socket", lambda: counted.append(1), logging.getLogger("t"), 5.0, clock
    )
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(10_000):
            dropped.drop(f"junk {i}")
        clock.now += 5.0
        dropped.drop("junk again")
    assert len(counted) == dropped.total == 10_001
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "handoff socket: dropped a frame: junk 0",
        "handoff socket: dropped a frame: junk again; 9999 more dropped since the last report",
    ]


def test_throughput_counts_over_its_window_only():
    clock = Clock()
    rate = Throughput(window_s=10.0, clock=clock)
    assert rate.per_second() == rate.per_busy_second() == 0.0
    rate.record(100, busy_seconds=0.5)
    clock.now += 4.0
    rate.record(300, busy_seconds=1.5)
    assert rate.per_busy_second() == 200.0  # 400 tokens in 2 s of steps
    assert rate.per_second() == 100.0  # 400 over the 4 s they span
    clock.now += 8.0  # the first falls out of the window
    assert rate.per_busy_second() == 200.0 and rate.per_second() == 300 / 8
