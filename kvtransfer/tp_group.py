"""KV transfer between tensor-parallel workers: every rank moves its own KV heads.

Each rank of a tensor-parallel worker holds some of the model's KV heads in a pool of its own,
under the same page ids as rank 0, which alone allocates pages (``common/engine/tp_group.py``).
So every rank of the prefill group runs a sender over its pool, every rank of the decode group
a receiver over its own, and each decode rank fetches exactly the heads it holds from prefill
ranks that hold them (``head_map.py``)::

    prefill rank 0 (GroupSender)                 decode rank 0 (GroupReceiver)
      publish: its own sender, then each          start_fetch: plans every decode rank's
      follower's (Publish down the step pipe,     reads, starts its own (start_read) and
      acknowledged) before the handoff leaves;    has each follower start its (Read down the
      the params list every rank's endpoint       step pipe); a follower reports ReadDone
      and heads (TransferParams.ranks)            when its read ends
      poll: rank 0's sender reports the lease     poll: once every read of the transfer has
      over; the followers drop theirs (EndLease)  ended, ReleasePages to prefill rank 0 alone

Page lifetime stays rank 0's on both sides: prefill rank 0 frees the pages only when its own
lease ends, and its lease ends only on the decode group's one release, sent once every decode
rank holds its copy (or has stopped writing after a failure); a read of a share sends no
release of its own. A follower that freed or reused pages on its own would let a new prompt
overwrite pages another rank is still reading. Whatever fails (a read, a handshake, a rank's
layout) fails the whole fetch, and the decode worker prefills the prompt itself, as after any
failed fetch.

A follower runs its sender or receiver on a thread of its own (``RankKV``), polled on its
sockets, so it serves and fetches while the follower's main thread runs forwards or waits on
the step pipe. Between workers at tensor-parallel size 1 nothing here is in the way: the params
carry no ranks and a receiver holding every head fetches as it always has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field

import zmq

from common import cluster_auth
from common.cluster_auth import ClusterAuth
from common.engine.kv_pool import KVPool
from common.engine.tp_group import FollowerRank, FollowerRanks, RankCommand
from common.kv_layout import KVLayout
from common.protocol import PrefixSource, RankSender
from kvtransfer.base import (
    KVReceiver,
    KVSender,
    TransferError,
    TransferParams,
    TransferResult,
    check_fetch,
    check_page_ids,
)
from kvtransfer.head_map import plan_heads
from kvtransfer.receiver import SideChannelReceiver
from kvtransfer.registry import create_receiver, create_sender
from kvtransfer.sender import SideChannelSender
from kvtransfer.ucx_interface import UCX_NET_DEVICES, pin_ucx_to_host

logger = logging.getLogger(__name__)

# How long rank 0 waits for a follower to open its sender or receiver (a NIXL agent registers
# the pool), and to acknowledge a publication.
OPEN_TIMEOUT_S = 120.0
PUBLISH_TIMEOUT_S = 30.0
# How long a follower's KV thread sleeps on its sockets: a READ carried out by UCX threads has no
# socket to wake it, so it looks again this often while one is running, and leases are swept at
# the idle interval.
_BUSY_POLL_S = 0.001
_IDLE_POLL_S = 0.1
_SERVICE = "kv"


# -- commands and reports between rank 0 and a follower ------------------------------------------


@dataclass(slots=True)
class Opened:
    """A follower's sender or receiver is up: where it listens (a sender) and its heads."""

    endpoint: str | None
    layout: KVLayout | None
    error: str | None = None


@dataclass(slots=True)
class Published:
    transfer_id: str
    error: str | None = None


@dataclass(slots=True)
class ReadDone:
    read_id: str
    ok: bool
    error: str | None
    nbytes: int


@dataclass(slots=True)
class OpenKV(RankCommand):
    """Start the follower's KV thread with a sender (``sender``) or a receiver over its pool;
    answered by ``Opened``. Carries what rank 0's side channel was set up with: the cluster
    secret its sockets prove, and the network devices UCX is pinned to (rank 0 pins them
    after it has spawned the others)."""

    backend: str
    engine_id: str
    sender: bool
    host: str
    secret: str | None
    ucx_net_devices: str | None

    def run(self, rank: FollowerRank) -> None:
        if _SERVICE in rank.services:
            rank.report(Opened(None, None, "this rank's KV transfer is already open"))
            return
        rank.services[_SERVICE] = RankKV(self, rank)


class KVCommand(RankCommand):
    """A command for a follower's KV thread (``RankKV``), which runs ``apply`` there."""

    __slots__ = ()

    def run(self, rank: FollowerRank) -> None:
        service = rank.services.get(_SERVICE)
        if isinstance(service, RankKV):
            service.submit(self)
        else:
            logger.error("%r reached a rank whose KV transfer is not open", self)

    @abstractmethod
    def apply(self, kv: RankKV) -> None: ...


@dataclass(slots=True)
class Publish(KVCommand):
    """Publish the same pages of this rank's pool; answered by ``Published``."""

    transfer_id: str
    page_ids: list[int]
    lease_seconds: float

    def apply(self, kv: RankKV) -> None:
        error = None
        try:
            kv.sender_of(self).publish(self.transfer_id, self.page_ids, self.lease_seconds)
        except ValueError as exc:
            error = f"rank {kv.rank.rank}: {exc}"
        kv.rank.report(Published(self.transfer_id, error))


@dataclass(slots=True)
class AbortLease(KVCommand):
    """Rank 0 aborted the transfer: refuse and stop its readers here too."""

    transfer_id: str

    def apply(self, kv: RankKV) -> None:
        kv.sender_of(self).abort(self.transfer_id)


@dataclass(slots=True)
class EndLease(KVCommand):
    """Rank 0's lease is over (released or expired): nothing reads the pages any more."""

    transfer_id: str

    def apply(self, kv: RankKV) -> None:
        kv.sender_of(self).end_lease(self.transfer_id)


@dataclass(slots=True)
class Read(KVCommand):
    """Fetch this rank's share of a transfer; ``ReadDone`` reports its end."""

    read_id: str
    transfer_id: str
    params: TransferParams  # names the prefill rank that serves the share
    heads: range
    dst_page_ids: list[int]
    timeout: float

    def apply(self, kv: RankKV) -> None:
        receiver = kv.receiver_of(self)
        try:
            receiver.start_read(self.read_id, self.transfer_id, self.params, self.heads,
                                self.dst_page_ids, self.timeout)  # fmt: skip
        except TransferError as exc:
            kv.rank.report(ReadDone(self.read_id, False, str(exc), 0))


@dataclass(slots=True)
class AbortRead(KVCommand):
    """Stop a read; it still reports its end (``ReadDone``, failed)."""

    read_id: str

    def apply(self, kv: RankKV) -> None:
        kv.receiver_of(self).abort(self.read_id)


class WrongRole(RuntimeError):
    """A command for a sender reached a receiver's rank, or the other way round."""


class RankKV:
    """A follower's sender or receiver, on a thread of its own: it takes commands from the
    follower's main thread through a queue (and a byte on a pipe that wakes its poll), polls
    its sockets, and reports to rank 0."""

    def __init__(self, spec: OpenKV, rank: FollowerRank) -> None:
        self.spec, self.rank = spec, rank
        self.sender: SideChannelSender | None = None
        self.receiver: SideChannelReceiver | None = None
        self._commands: queue.SimpleQueue[KVCommand | None] = queue.SimpleQueue()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._thread = threading.Thread(target=self._main, name="tp-rank-kv", daemon=True)
        self._thread.start()

    def submit(self, command: KVCommand | None) -> None:
        """Queue ``command`` for the thread (None: close and stop)."""
        self._commands.put(command)
        os.write(self._wake_write, b"\0")

    def close(self) -> None:
        self.submit(None)
        self._thread.join(10.0)

    def sender_of(self, command: KVCommand) -> SideChannelSender:
        if self.sender is None:
            raise WrongRole(f"{command!r} reached a rank without a KV sender")
        return self.sender

    def receiver_of(self, command: KVCommand) -> SideChannelReceiver:
        if self.receiver is None:
            raise WrongRole(f"{command!r} reached a rank without a KV receiver")
        return self.receiver

    def _main(self) -> None:
        spec, pool = self.spec, self.rank.pool
        if spec.secret is not None:
            cluster_auth.install(ClusterAuth(spec.secret, lambda name: None, quiet=True))
        if spec.ucx_net_devices is not None:
            os.environ.setdefault(UCX_NET_DEVICES, spec.ucx_net_devices)
        endpoint: KVSender | KVReceiver
        try:
            if spec.sender:
                endpoint = create_sender(spec.backend, pool, spec.engine_id, spec.host)
            else:
                endpoint = create_receiver(spec.backend, pool, spec.engine_id)
        except Exception as exc:
            logger.exception("tensor-parallel rank %d could not open KV transfer", self.rank.rank)
            self.rank.report(Opened(None, None, f"rank {self.rank.rank}: {exc}"))
            return
        if isinstance(endpoint, SideChannelSender):
            self.sender = endpoint
        elif isinstance(endpoint, SideChannelReceiver):
            self.receiver = endpoint
        self.rank.report(Opened(self.sender.endpoint if self.sender else None, pool.layout))
        try:
            while self._serve_once(endpoint):
                pass
        finally:
            endpoint.close()
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _serve_once(self, endpoint: KVSender | KVReceiver) -> bool:
        """One wait and one round of work; False once told to stop."""
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        for socket in endpoint.poll_sockets():
            poller.register(socket, zmq.POLLIN)
        busy = self.receiver is not None and self.receiver.progressing_silently()
        poller.poll(round(1000 * (_BUSY_POLL_S if busy else _IDLE_POLL_S)))
        with contextlib.suppress(BlockingIOError):  # woken by its sockets, not a command
            os.read(self._wake_read, 4096)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is None:
                return False
            try:
                command.apply(self)
            except WrongRole as exc:
                logger.error("%s", exc)
        if self.sender is not None:
            self.sender.poll()  # the pages are rank 0's: its lease says when they are free
        if self.receiver is not None:
            for result in self.receiver.poll():
                self.rank.report(
                    ReadDone(result.transfer_id, result.ok, result.error, result.nbytes)
                )
        return True


def open_followers(
    followers: FollowerRanks,
    backend: str,
    engine_id: str,
    sender: bool,
    host: str,
    secret: str | None,
) -> list[Opened]:
    """Open a sender (or receiver) on every follower; their answers, ranks 1.. in order."""
    ucx_net_devices = os.environ.get(UCX_NET_DEVICES)
    for rank in range(1, followers.size):
        name = f"{engine_id}.rank{rank}"
        followers.command(rank, OpenKV(backend, name, sender, host, secret, ucx_net_devices))
    opened = []
    for rank in range(1, followers.size):
        answer = followers.wait_report(rank, OPEN_TIMEOUT_S)
        if not isinstance(answer, Opened) or answer.error is not None or answer.layout is None:
            raise RuntimeError(f"tensor-parallel rank {rank} could not open KV transfer: {answer}")
        opened.append(answer)
    return opened


# -- prefill rank 0 ------------------------------------------------------------------------------


class GroupSender(KVSender):
    """Prefill rank 0's sender for a tensor-parallel group: its own pages through its own
    sender, the other ranks' through theirs (see the module docstring). Called like any
    KVSender, by the worker's main loop (``serve_requests`` by its step helper)."""

    def __init__(
        self,
        own: KVSender,
        pool: KVPool,
        engine_id: str,
        followers: FollowerRanks,
        host: str,
        secret: str | None,
    ) -> None:
        self.backend = own.backend
        self._own = own
        self._followers = followers
        try:
            opened = open_followers(followers, own.backend, engine_id, True, host, secret)
        except BaseException:
            own.close()
            raise
        layouts = [pool.layout] + [o.layout for o in opened]
        endpoints = [(own.endpoint, engine_id)] + [
            (o.endpoint, f"{engine_id}.rank{rank}") for rank, o in enumerate(opened, start=1)
        ]
        self.ranks = [
            RankSender(endpoint or "", name, layout.first_kv_head, layout.num_kv_heads)
            for (endpoint, name), layout in zip(endpoints, layouts, strict=True)
            if layout is not None
        ]

    @property
    def endpoint(self) -> str:
        return self._own.endpoint

    def publish(
        self, transfer_id: str, page_ids: list[int], lease_seconds: float
    ) -> TransferParams:
        params = self._own.publish(transfer_id, page_ids, lease_seconds)
        # Every follower publishes before the handoff can leave, so that no decode rank asks
        # a rank for a transfer it has not heard of yet.
        command = Publish(transfer_id, list(page_ids), lease_seconds)
        for rank in range(1, self._followers.size):
            self._followers.command(rank, command)
        errors = []
        for rank in range(1, self._followers.size):
            error = self._wait_published(rank, transfer_id)
            if error is not None:
                errors.append(error)
        if errors:
            self.abort(transfer_id)  # rank 0's lease comes back through poll()
            raise ValueError(f"the group could not publish {transfer_id!r}: {'; '.join(errors)}")
        params.ranks = list(self.ranks)
        return params

    def _wait_published(self, rank: int, transfer_id: str) -> str | None:
        """Why rank ``rank`` did not publish ``transfer_id``, or None once it has. Skips the
        answer to an earlier publication that came after its wait had given up."""
        deadline = time.monotonic() + PUBLISH_TIMEOUT_S
        while True:
            try:
                answer = self._followers.wait_report(rank, max(0.0, deadline - time.monotonic()))
            except TimeoutError as exc:
                return str(exc)
            if isinstance(answer, Published) and answer.transfer_id == transfer_id:
                return answer.error
            logger.warning("rank %d's late answer dropped: %r", rank, answer)

    def poll(self) -> list[str]:
        released = self._own.poll()
        for transfer_id in released:
            self._tell_followers(EndLease(transfer_id))
        return released

    def serve_requests(self) -> None:
        self._own.serve_requests()

    def poll_sockets(self) -> list:
        return self._own.poll_sockets()

    def abort(self, transfer_id: str) -> None:
        self._own.abort(transfer_id)
        self._tell_followers(AbortLease(transfer_id))

    def close(self) -> None:
        self._own.close()

    def _tell_followers(self, command: KVCommand) -> None:
        for rank in range(1, self._followers.size):
            try:
                self._followers.command(rank, command)
            except OSError:  # a rank gone: the group is ending
                return


# -- decode rank 0 -------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class GroupFetch:
    """One transfer fetched by the ranks of a decode group, read by read."""

    transfer_id: str
    params: TransferParams  # the handoff's: prefill rank 0 holds the lease
    num_pages: int
    started: float
    reads: dict[str, int] = field(default_factory=dict)  # read id -> decode rank, still running
    error: str | None = None
    nbytes: int = 0


class GroupReceiver(KVReceiver):
    """A decode worker's receiver whatever the tensor-parallel sizes: a fetch between pools of
    every head goes straight to this rank's own receiver; any other is split into reads of
    each decode rank's heads from the prefill ranks that hold them (see the module docstring).
    Called like any KVReceiver, by the decode worker's main loop."""

    def __init__(
        self, own: SideChannelReceiver, followers: FollowerRanks | None, secret: str | None
    ) -> None:
        self.backend = own.backend
        self._own = own
        self._followers = followers
        layouts = [own.pool.layout]
        if followers is not None:
            engine_id = own.engine_id
            try:
                opened = open_followers(
                    followers, own.backend, engine_id, False, "127.0.0.1", secret
                )
            except BaseException:
                own.close()
                raise
            layouts += [o.layout for o in opened if o.layout is not None]
        self._rank_heads = [layout.heads for layout in layouts]
        self._groups: dict[str, GroupFetch] = {}
        self._reads: dict[str, GroupFetch] = {}  # read id -> its group

    @property
    def _holds_every_head(self) -> bool:
        return len(self._rank_heads) == 1 and self._own.pool.layout.holds_all_heads

    def start_fetch(
        self,
        transfer_id: str,
        params: TransferParams,
        dst_page_ids: list[int],
        timeout: float,
    ) -> None:
        if not params.ranks and self._holds_every_head:
            self._own.start_fetch(transfer_id, params, dst_page_ids, timeout)
            return
        if transfer_id in self._groups:
            raise TransferError(f"transfer {transfer_id!r} is already being fetched")
        check_fetch(self.backend, params, dst_page_ids)
        check_page_ids(dst_page_ids, self._own.pool.num_pages, "dst_page_ids")
        sources = params.ranks or [
            RankSender(params.endpoint, params.engine_id, 0, self._own.pool.layout.total_kv_heads)
        ]
        try:
            plans = [plan_heads(heads, [s.heads for s in sources]) for heads in self._rank_heads]
        except ValueError as exc:
            raise TransferError(f"this decode group cannot be served: {exc}") from exc
        group = GroupFetch(transfer_id, params, len(dst_page_ids), time.monotonic())
        self._groups[transfer_id] = group
        for rank, plan in enumerate(plans):
            for share in plan:
                source = sources[share.source]
                read_id = f"{transfer_id}@{rank}.{share.source}"
                source_params = TransferParams(
                    params.backend,
                    source.endpoint,
                    source.engine_id,
                    params.page_ids,
                    params.lease_deadline,
                )
                group.reads[read_id] = rank
                self._reads[read_id] = group
                self._start_read(rank, read_id, transfer_id, source_params, share.heads,
                                 list(dst_page_ids), timeout)  # fmt: skip

    def start_prefix_fetch(
        self,
        transfer_id: str,
        source: PrefixSource,
        parent: int | None,
        page_hashes: list[int],
        token_ids: list[int],
        dst_page_ids: list[int],
        timeout: float,
    ) -> None:
        if not self._holds_every_head:
            raise TransferError("a tensor-parallel decode group fetches no prefixes")
        self._own.start_prefix_fetch(
            transfer_id, source, parent, page_hashes, token_ids, dst_page_ids, timeout
        )

    def poll(self) -> list[TransferResult]:
        results = []
        for result in self._own.poll():
            if result.transfer_id in self._reads:
                self._read_ended(result.transfer_id, result.ok, result.error, result.nbytes)
            else:
                results.append(result)  # a fetch between whole pools
        if self._followers is not None:
            for rank in range(1, self._followers.size):
                for report in self._followers.reports(rank):
                    if isinstance(report, ReadDone):
                        self._read_ended(report.read_id, report.ok, report.error, report.nbytes)
        for group in [g for g in self._groups.values() if not g.reads]:
            results.append(self._end(group))
        return results

    def serve_transfers(self) -> None:
        # This rank's own reads; the other ranks move their shares in their own processes, and
        # their reports wait for poll.
        self._own.serve_transfers()

    def poll_sockets(self) -> list:
        pipes = self._followers.report_pipes if self._followers is not None else []
        return [*self._own.poll_sockets(), *pipes]

    def transfer_sockets(self) -> list:
        return self._own.transfer_sockets()

    def progressing_silently(self) -> bool:
        return self._own.progressing_silently()

    def abort(self, transfer_id: str) -> None:
        group = self._groups.get(transfer_id)
        if group is None:
            self._own.abort(transfer_id)
        else:
            self._stop(group, "aborted")

    def close(self) -> None:
        for group in self._groups.values():
            self._own.release(group.params, group.transfer_id, ok=False)
        self._groups.clear()
        self._own.close()

    # -- internals ----------------------------------------------------------------------------

    def _start_read(
        self,
        rank: int,
        read_id: str,
        transfer_id: str,
        params: TransferParams,
        heads: range,
        dst_page_ids: list[int],
        timeout: float,
    ) -> None:
        if rank > 0:
            assert self._followers is not None
            command = Read(read_id, transfer_id, params, heads, dst_page_ids, timeout)
            self._followers.command(rank, command)
            return
        try:
            self._own.start_read(read_id, transfer_id, params, heads, dst_page_ids, timeout)
        except TransferError as exc:
            self._read_ended(read_id, False, str(exc), 0)

    def _read_ended(self, read_id: str, ok: bool, error: str | None, nbytes: int) -> None:
        group = self._reads.pop(read_id, None)
        if group is None:
            return
        rank = group.reads.pop(read_id)
        group.nbytes += nbytes
        if not ok and group.error is None:
            # One share missing fails the whole fetch: stop the others writing, quickly.
            self._stop(group, f"decode rank {rank}: {error}")

    def _stop(self, group: GroupFetch, error: str) -> None:
        group.error = group.error or error
        for read_id, rank in group.reads.items():
            if rank == 0:
                self._own.abort(read_id)
            else:
                assert self._followers is not None
                self._followers.command(rank, AbortRead(read_id))

    def _end(self, group: GroupFetch) -> TransferResult:
        """Every read has ended: release the lease (prefill rank 0's) and report."""
        del self._groups[group.transfer_id]
        ok = group.error is None
        self._own.release(group.params, group.transfer_id, ok)
        return TransferResult(
            group.transfer_id,
            ok,
            group.error,
            group.num_pages,
            group.nbytes if ok else 0,
            time.monotonic() - group.started,
        )


def keep_ucx_on_host(backend: str, host: str) -> None:
    """Before the first NIXL agent of the process starts UCX: its listeners stay on the
    interface of ``host``, the address the worker serves on (``kvtransfer/ucx_interface.py``);
    the followers of a tensor-parallel group are handed the same setting when they open."""
    if backend == "nixl":
        logger.info("UCX network devices: %s", pin_ucx_to_host(host) or "all")


def group_sender(
    backend: str,
    pool: KVPool,
    engine_id: str,
    host: str,
    followers: FollowerRanks | None,
    secret: str | None,
) -> KVSender:
    """The sender of a prefill worker: a plain one, or a group's at tensor-parallel size > 1
    (``secret``: the cluster secret the followers' side channels prove, if any). The first of a
    process's KV endpoints: NIXL's network is set here (``keep_ucx_on_host``)."""
    keep_ucx_on_host(backend, host)
    own = create_sender(backend, pool, engine_id, host)
    if followers is None:
        return own
    return GroupSender(own, pool, engine_id, followers, host, secret)


def group_receiver(
    backend: str,
    pool: KVPool,
    engine_id: str,
    host: str,
    followers: FollowerRanks | None,
    secret: str | None,
) -> GroupReceiver:
    """The receiver of a decode worker, which takes pages from prefill workers of any
    tensor-parallel size; like ``group_sender``, the first of its process's KV endpoints."""
    keep_ucx_on_host(backend, host)
    own = create_receiver(backend, pool, engine_id)
    assert isinstance(own, SideChannelReceiver)
    return GroupReceiver(own, followers, secret)
