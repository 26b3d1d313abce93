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

Between steps the pipes also carry ``RankCommand``s: work rank 0 has a rank do besides forwards
(its share of a KV transfer, ``kvtransfer/tp_group.py``). A follower runs each as it reads it,
and answers, when the command asks for it, with a report back up the same (duplex) pipe, which
rank 0 reads with ``reports`` / ``wait_report``. These are pickled: a pipe between the processes
of one worker, never the network.
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
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch

from common.engine.batch import TokenRun
from common.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)

# How long close() waits for a rank to leave after being told to, before terminating it.
_LEAVE_TIMEOUT_S = 30.0
# The exit status of rank 0 when another rank died under it.
RANK_LOST_EXIT_CODE = 70

# A rank's entry point: (rank, rendezvous port, its end of rank 0's pipe).
FollowerMain = Callable[[int, int, Connection], None]


@dataclass(slots=True, eq=False)
class FollowerRank:
    """What a ``RankCommand`` may use on the follower that runs it: its rank, its KV pool, the
    services earlier commands started (by name), and ``report`` to answer rank 0."""

    rank: int
    pool: KVPool
    pipe: Connection
    services: dict[str, object] = field(default_factory=dict)
    _send_lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, message: object) -> None:
        """Send ``message`` up to rank 0 (from any thread of this rank)."""
        with self._send_lock, contextlib.suppress(OSError):  # rank 0 gone: the loop leaves
            self.pipe.send(message)


class RankCommand(ABC):
    """Work rank 0 sends a follower besides steps; run on the follower's main thread, between
    its forwards, in the order sent. It must not block: anything long goes to a service
    thread of the rank's own."""

    @abstractmethod
    def run(self, rank: FollowerRank) -> None: ...


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
    def size(self) -> int:
        """The group's size, rank 0 included."""
        return len(self._pipes) + 1

    @property
    def report_pipes(self) -> list[Connection]:
        """Rank 0's ends of the pipes, ranks 1.. in order: readable when a report is waiting
        (a ``zmq.Poller`` takes them beside sockets)."""
        return list(self._pipes)

    def command(self, rank: int, command: RankCommand) -> None:
        """Have rank ``rank`` (1..N-1) run ``command`` between its steps."""
        self._pipes[rank - 1].send(command)

    def reports(self, rank: int) -> list[object]:
        """The reports rank ``rank`` has sent since the last call; never blocks."""
        pipe, found = self._pipes[rank - 1], []
        with contextlib.suppress(EOFError, OSError):  # a lost rank: the watch ends the group
            while pipe.poll():
                found.append(pipe.recv())
        return found

    def wait_report(self, rank: int, timeout: float) -> object:
        """The next report of rank ``rank``; TimeoutError if none comes within ``timeout``."""
        pipe = self._pipes[rank - 1]
        if not pipe.poll(timeout):
            raise TimeoutError(f"tensor-parallel rank {rank} did not answer in {timeout:.0f}s")
        return pipe.recv()

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


def serve_steps(
    pipe: Connection, run_forward: Callable[[list[TokenRun]], None], rank: FollowerRank
) -> None:
    """A follower rank's loop: run each step (and command) rank 0 sends until it says to stop
    or is gone; then close the services its commands started."""
    try:
        while True:
            try:
                message = pipe.recv()
            except (EOFError, OSError):
                logger.warning("rank 0 of the tensor-parallel group is gone: leaving")
                return
            if message is None:
                return
            if isinstance(message, RankCommand):
                message.run(rank)
            else:
                run_forward(message)
    finally:
        for service in rank.services.values():
            close = getattr(service, "close", None)
            if close is not None:
                close()
