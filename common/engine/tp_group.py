"""The processes of a tensor-parallel engine: rank 0 is the engine its caller built (it runs the
scheduler, samples, and alone speaks to the outside); it spawns ranks 1..N-1 on this machine,
each an engine of its own shard that runs whatever forward rank 0 sends it.

Each step rank 0 sends every other rank the step's token runs down a pipe of its own (a few
hundred bytes of ids and page numbers; each rank flattens them itself, as rank 0 does) before
its own forward, whose collectives then pair up with theirs. The pipes also carry the group's
life: a rank whose pipe reads end-of-file has lost rank 0 and exits; rank 0 watches the other
ranks' processes and, if one ends while the group is open, logs which and exits at once (its
collectives could never complete), so the router sees the whole worker go and migrates its
requests as it does for any dead worker.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch

from common.engine.batch import TokenRun

logger = logging.getLogger(__name__)

# How long close() waits for a rank to leave after being told to, before terminating it.
_LEAVE_TIMEOUT_S = 30.0
# The exit status of rank 0 when another rank died under it.
RANK_LOST_EXIT_CODE = 70

# A rank's entry point: (rank, rendezvous port, its end of rank 0's pipe).
FollowerMain = Callable[[int, int, Connection], None]


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class FollowerRanks:
    """Ranks 1..N-1 as seen from rank 0: their processes and the pipes to them."""

    def __init__(self, main: FollowerMain, size: int) -> None:
        """Spawn ranks 1..``size``-1, each running ``main(rank, port, pipe)``; they rendezvous
        with rank 0 on loopback ``self.port``."""
        self.port = free_loopback_port()
        self._closing = threading.Event()
        self._pipes: list[Connection] = []
        self._processes: list[BaseProcess] = []
        # Spawned, not forked: a fork of a process with threads and a CUDA context is unsafe.
        context = multiprocessing.get_context("spawn")
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=main, args=(rank, self.port, theirs), name=f"tp-rank-{rank}", daemon=True
            )
            process.start()
            theirs.close()  # the rank's copy: when ours closes, it reads end-of-file
            self._pipes.append(ours)
            self._processes.append(process)
        threading.Thread(target=self._watch, name="tp-ranks-watch", daemon=True).start()
        # Before multiprocessing's own exit hook (registered earlier, so run later) terminates
        # the ranks, which the watch would take for a rank lost.
        atexit.register(self.close)

    @property
    def pids(self) -> list[int | None]:
        """The process ids of ranks 1..N-1, in rank order."""
        return [process.pid for process in self._processes]

    def send_step(self, runs: Sequence[TokenRun]) -> None:
        """Have every other rank run the forward of ``runs`` (rank 0 runs its own after)."""
        message = list(runs)
        for pipe in self._pipes:
            pipe.send(message)

    def close(self) -> None:
        """Tell every rank to leave, and wait for them (terminating any that lingers)."""
        if self._closing.is_set():
            return
        self._closing.set()
        for pipe in self._pipes:
            with contextlib.suppress(OSError):  # already gone
                pipe.send(None)
            pipe.close()
        for process in self._processes:
            process.join(_LEAVE_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join()

    def _watch(self) -> None:
        sentinels = {process.sentinel: process for process in self._processes}
        ended = wait(list(sentinels))
        if self._closing.is_set():
            return
        process = sentinels[ended[0]]  # type: ignore[index]
        process.join(1.0)  # its exit status
        logger.error(
            "tensor-parallel %s exited with status %s: the group cannot run without it, "
            "rank 0 exits too",
            process.name,
            process.exitcode,
        )
        logging.shutdown()
        os._exit(RANK_LOST_EXIT_CODE)


def take_share_of_cores(rank: int, size: int) -> None:
    """On a CPU the ranks of a group would each run as many threads as the group's cores
    (``pdserve up`` pins a worker to its share and sets ``OMP_NUM_THREADS`` to its size), so
    every core would run ``size`` spinning threads; each rank keeps its own slice instead
    (where there are fewer cores than ranks, they share)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < size:
        return
    mine = cores[rank * len(cores) // size : (rank + 1) * len(cores) // size]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


def ignore_stop_signals() -> None:
    """For ranks 1..N-1: Ctrl-C reaches the whole process group and a drain's SIGTERM is rank
    0's to act on; the others leave when rank 0 tells them or is gone, never on their own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def serve_steps(pipe: Connection, run_forward: Callable[[list[TokenRun]], None]) -> None:
    """A follower rank's loop: run each step rank 0 sends until it says to stop or is gone."""
    while True:
        try:
            runs = pipe.recv()
        except (EOFError, OSError):
            logger.warning("rank 0 of the tensor-parallel group is gone: leaving")
            return
        if runs is None:
            return
        run_forward(runs)
