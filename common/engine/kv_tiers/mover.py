"""The mover: one thread that copies pages between the tiers and the pool off the step thread.

Jobs run in the order given. The step thread hands a job everything it may touch: the pool
pages a restore writes belong to a sequence that is not scheduled until the job is done, the
host slots it reads are pinned, and a write to disk carries its own copy of the bytes. So a job
never races the forward, and the step thread only looks at ``done``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Job:
    """Work for the mover thread; ``done`` is set (after everything it wrote) once it ran."""

    work: Callable[[Job], None]
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False  # set by the step thread: do nothing more that is not needed
    seconds: float = 0.0
    error: str | None = None


class Mover:
    def __init__(self, name: str = "kv-tier-mover") -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._finished = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        self._jobs.put(job)
        return job

    def wait_any(self, jobs: list[Job], timeout: float) -> bool:
        """Block until one of ``jobs`` is done or ``timeout`` seconds pass; whether one is."""
        with self._finished:
            return self._finished.wait_for(lambda: any(j.done.is_set() for j in jobs), timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; whether they have."""
        return self.submit(Job(lambda job: None)).done.wait(timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            started = time.perf_counter()
            try:
                job.work(job)
            except Exception as exc:  # a failed copy is a miss, never a dead worker
                logger.exception("KV tier job failed")
                job.error = str(exc) or type(exc).__name__
            job.seconds = time.perf_counter() - started
            with self._finished:
                job.done.set()
                self._finished.notify_all()
