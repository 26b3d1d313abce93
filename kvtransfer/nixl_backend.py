"""KV transfer over NIXL (UCX): the receiver READs the pages straight out of the sender's pool.

Both sides register their whole pool with a NIXL agent once. The handshake on the ZMQ side
channel carries the sender's agent metadata and the pool's base addresses; a fetch is then a
FetchRequest / FetchReady exchange (so the sender knows its pages are being read, and a lease
that is over or aborted is refused before any READ), one READ with a descriptor per run of
consecutive pages (and per run of scales), and a ReleasePages acknowledgement.

The agents run without NIXL's progress thread, which busy-polls a core even when idle: UCX is
progressed from ``poll()`` instead, on both sides, by the worker's own loop. With the UCX TCP +
CMA transports used on one host, the READ itself is carried out by the reading process
(process_vm_readv) once the connection is up; the sender's ``poll`` only has to run for the
connection set-up.

Between tensor-parallel ranks that hold different KV heads, a page's share of heads is strided
(``head_slices.py``): as descriptors it would be one per layer, K/V and token, thousands per
page of a few hundred bytes. The receiver instead READs the sender's whole pages (its pool holds
only its own rank's heads, so that is at most the heads it serves) into staging memory that it
registers for that READ, and copies its heads out of them once the READ is done. Where both
pools hold exactly the heads moved (equal tensor-parallel sizes), pages are read in place as
between whole pools.

A receiver with more than one core to run on gives its UCX backend up to ``MAX_READ_THREADS``
threads of its own that split a READ's descriptors between them: a single thread cannot reach
memory bandwidth (process_vm_readv pins and copies one page table entry at a time; one reader
moved ~45% of memcpy's rate on a 2-core host, two ~60%). They sleep while no READ is posted, but
spin while one completes, so a process confined to one core (``pdserve up`` pins each worker
on a CPU host) gets none: there they only took turns with the worker's own thread, and a 4k-token
handoff took ~24 ms instead of ~8.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from common.engine.kv_pool import KVPool
from common.kv_layout import KVLayout
from kvtransfer.head_slices import as_pages, scatter_heads
from kvtransfer.messages import FetchReady, HandshakeReply, NixlAgentInfo
from kvtransfer.metrics import Failure
from kvtransfer.receiver import DRAINING, READING, REQUESTED, Fetch, Peer, SideChannelReceiver
from kvtransfer.sender import Lease, SideChannelSender
from kvtransfer.side_channel import Incoming

logger = logging.getLogger(__name__)

# How long past its deadline a failed fetch waits for a READ that could not be cancelled.
DRAIN_GRACE_S = 5.0
# At most this many threads carry out a receiver's READs, each with its own UCX worker.
MAX_READ_THREADS = 2
# A READ with at least this many descriptors is split between the read threads.
SPLIT_DESCRIPTORS = 4
# Longest run of pages one descriptor covers: a prompt whose pages lie in a row still becomes
# enough descriptors for every read thread to take a share.
MAX_RUN_PAGES = 16


def default_read_threads() -> int:
    """Read threads for a receiver in this process: one per core it may run on, up to
    MAX_READ_THREADS, and none on a single core."""
    cores = len(os.sched_getaffinity(0))
    return min(MAX_READ_THREADS, cores) if cores > 1 else 0


def create_agent(name: str, read_threads: int = 0) -> nixl_agent:
    """A NIXL agent with the UCX backend and no progress thread: nothing spins while idle.

    ``read_threads`` > 0 gives the backend that many threads that split large transfers between
    them; they block on a queue until a transfer is posted.
    """
    config = nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=False,
        backends=[],
    )
    agent = nixl_agent(name, config)
    params = {}
    if read_threads > 0:
        params = {"num_threads": str(read_threads), "split_batch_size": str(SPLIT_DESCRIPTORS)}
    if "UCX" in agent.plugin_list:
        agent.create_backend("UCX", params)
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend; the nixl KV transfer needs it")
    return agent


class _RegisteredPool:
    """A pool's tensors (or a fetch's staging) registered with an agent: where its pages are."""

    def __init__(self, agent: nixl_agent, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        self.agent = agent
        self.mem_type = "DRAM" if data.device.type == "cpu" else "VRAM"
        self.device_id = data.device.index or 0
        self.data_addr = data.data_ptr()
        self.scale_addr = scales.data_ptr() if scales is not None else None
        tensors = [data] if scales is None else [data, scales]
        self._registrations = [agent.register_memory(t) for t in tensors]

    def deregister(self) -> None:
        for registration in self._registrations:
            try:
                self.agent.deregister_memory(registration)
            except Exception:  # the agent may already be torn down at shutdown
                logger.exception("NIXL deregistration failed")
        self._registrations = []


class _StagedPages(_RegisteredPool):
    """A READ's landing place for whole pages of a sender whose heads differ from this pool's:
    its pages, registered for that one READ, then their heads copied into the pool."""

    def __init__(
        self,
        agent: nixl_agent,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        layout: KVLayout,  # the sender's
    ) -> None:
        super().__init__(agent, data, scales)
        self.tensors = [data] if scales is None else [data, scales]
        self.layout = layout

    def copy_heads_into(self, pool: KVPool, dst_page_ids: list[int], heads: range) -> None:
        """Write model KV heads ``heads`` of the staged pages into those of ``dst_page_ids``."""
        theirs = range(
            heads.start - self.layout.first_kv_head, heads.stop - self.layout.first_kv_head
        )
        ours = range(
            heads.start - pool.layout.first_kv_head, heads.stop - pool.layout.first_kv_head
        )
        pool_tensors = [pool.data] if pool.scales is None else [pool.data, pool.scales]
        for pool_tensor, rows in zip(pool_tensors, self.tensors, strict=True):
            pages = as_pages(rows, pool_tensor, self.layout.num_kv_heads)
            scatter_heads(
                pool_tensor, dst_page_ids, ours, pages.narrow(4, theirs.start, len(theirs))
            )


def page_runs(src: list[int], dst: list[int], max_run: int = MAX_RUN_PAGES) -> np.ndarray:
    """(first source page, first destination page, pages) rows, one per stretch of at most
    ``max_run`` pages over which both lists count up by one: each becomes one descriptor, so a
    prompt whose pages were allocated in a row moves in a few large reads instead of one per
    page."""
    src_ids, dst_ids = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    position = np.arange(len(src_ids))
    breaks = (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)
    run_starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    # Within a run, a new descriptor every max_run pages.
    run_of = np.searchsorted(run_starts, position, side="right") - 1
    starts = np.flatnonzero((position - run_starts[run_of]) % max_run == 0)
    lengths = np.diff(np.append(starts, len(src_ids)))
    return np.stack([src_ids[starts], dst_ids[starts], lengths], axis=1)


def run_descs(
    data_addr: int,
    scale_addr: int | None,
    first_pages: np.ndarray,
    lengths: np.ndarray,
    layout: KVLayout,
    device_id: int,
) -> np.ndarray:
    """(address, length, device) rows: one per run of pages, then one per run of scales."""
    spans = [(data_addr, layout.page_nbytes)]
    if scale_addr is not None:
        spans.append((scale_addr, layout.scale_page_nbytes))
    rows = []
    for base, nbytes in spans:
        table = np.empty((len(first_pages), 3), dtype=np.uint64)
        table[:, 0] = np.uint64(base) + first_pages.astype(np.uint64) * np.uint64(nbytes)
        table[:, 1] = lengths.astype(np.uint64) * np.uint64(nbytes)
        table[:, 2] = device_id
        rows.append(table)
    return np.concatenate(rows)


class NixlSender(SideChannelSender):
    backend = "nixl"

    def __init__(self, pool: KVPool, engine_id: str, host: str = "127.0.0.1", port: int = 0):
        super().__init__(pool, engine_id, host, port)
        agent_name = f"{engine_id}.sender.{self.instance_id}"
        try:
            self._agent = create_agent(agent_name)
            self._registered = _RegisteredPool(self._agent, pool.data, pool.scales)
        except Exception:
            self._channel.close()
            raise
        self._info = NixlAgentInfo(
            agent_name=agent_name,
            metadata=self._agent.get_agent_metadata(),
            data_addr=self._registered.data_addr,
            scale_addr=self._registered.scale_addr,
            mem_type=self._registered.mem_type,
            device_id=self._registered.device_id,
        )

    def _nixl_info(self) -> NixlAgentInfo:
        return self._info

    def _serve(self, identity: bytes, lease: Lease, heads: range) -> None:
        # The receiver READs whole pages and keeps the heads it asked for.
        if self._channel.send(FetchReady(lease.transfer_id, self.instance_id), identity):
            lease.in_flight = True

    def _still_reading(self, lease: Lease) -> bool:
        # After a FetchReady only the receiver knows when its READ is over: wait for its
        # ReleasePages (or the lease's end).
        return lease.in_flight is not None

    def _progress(self) -> None:
        # Fetching notifications is what progresses UCX here (connection set-up for new peers).
        # pdserve sends no NIXL notifications, so any that arrive are unexpected.
        for agent_name, notifs in self._agent.get_new_notifs().items():
            for _ in notifs:
                self._channel.reject(f"dropped an unexpected NIXL notification from {agent_name}")

    def _close_backend(self) -> None:
        self._registered.deregister()


class NixlReceiver(SideChannelReceiver):
    backend = "nixl"

    def __init__(self, pool: KVPool, engine_id: str, read_threads: int | None = None):
        super().__init__(pool, engine_id)
        if read_threads is None:
            read_threads = default_read_threads()
        self._agent = create_agent(f"{engine_id}.receiver.{uuid.uuid4().hex[:12]}", read_threads)
        self._registered = _RegisteredPool(self._agent, pool.data, pool.scales)
        self._abandoned: list[object] = []  # READs that never stopped; kept so they stay valid

    def _connect(self, peer: Peer, reply: HandshakeReply) -> str | None:
        info = reply.nixl
        if info is None:
            return "the sender offered no NIXL agent"
        if info.mem_type not in ("DRAM", "VRAM"):
            return f"unknown memory type {info.mem_type!r}"
        if (info.scale_addr is None) != (self.pool.scales is None):
            return "the sender's pool and this one disagree on page scales"
        try:
            name = self._agent.add_remote_agent(info.metadata)
        except Exception as exc:  # NIXL raises its own exception types
            return f"cannot load the sender's NIXL agent: {exc}"
        name = name.decode() if isinstance(name, bytes) else name
        if name != info.agent_name:
            self._remove_agent(name)
            return f"agent metadata names {name!r}, expected {info.agent_name!r}"
        peer.remote = name
        try:
            # Starts the UCX connection now rather than on the first READ.
            self._agent.make_connection(name)
        except Exception as exc:
            logger.warning("NIXL could not pre-connect to %s: %s", name, exc)
        return None

    def _disconnect(self, peer: Peer) -> None:
        if isinstance(peer.remote, str):
            self._remove_agent(peer.remote)

    def _on_reply(self, fetch: Fetch, incoming: Incoming) -> None:
        msg = incoming.msg
        if not isinstance(msg, FetchReady) or fetch.state != REQUESTED:
            self._reject(fetch.peer, f"dropped unexpected {type(msg).__name__}")
            return
        self._post_read(fetch)

    def _post_read(self, fetch: Fetch) -> None:
        reply = fetch.peer.reply
        assert reply is not None and reply.nixl is not None
        info = reply.nixl
        in_place = fetch.heads == self.pool.layout.heads == reply.layout.heads
        try:
            if in_place:
                registered, dst = self._registered, fetch.dst_page_ids
            else:
                registered = fetch.staging = self._staging(len(fetch.dst_page_ids), reply)
                dst = list(range(len(fetch.dst_page_ids)))
        except Exception as exc:
            self._fail(fetch, f"NIXL could not register staging: {exc}", Failure.TRANSPORT)
            return
        runs = page_runs(fetch.params.page_ids, dst)
        # Both sides' pages are the sender's (in place, the two layouts are the same size).
        layout, lengths = reply.layout, runs[:, 2]
        local = run_descs(
            registered.data_addr,
            registered.scale_addr,
            runs[:, 1],
            lengths,
            layout,
            registered.device_id,
        )
        remote = run_descs(
            info.data_addr, info.scale_addr, runs[:, 0], lengths, layout, info.device_id
        )
        agent = self._agent
        try:
            fetch.handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, registered.mem_type),
                agent.get_xfer_descs(remote, info.mem_type),
                fetch.peer.remote,
            )
            fetch.state = READING
            state = agent.transfer(fetch.handle)
        except Exception as exc:
            self._fail(fetch, f"NIXL READ could not start: {exc}", Failure.TRANSPORT)
            return
        self._settle(fetch, state)

    def _staging(self, num_pages: int, reply: HandshakeReply) -> _StagedPages:
        """Memory for ``num_pages`` of the sender's pages, registered for one READ."""
        layout, device = reply.layout, self.pool.device
        data = torch.empty((num_pages, layout.page_nbytes), dtype=torch.uint8, device=device)
        scales = None
        if layout.scale_page_nbytes:
            scales = torch.empty(
                (num_pages, layout.scale_page_nbytes), dtype=torch.uint8, device=device
            )
        return _StagedPages(self._agent, data, scales, layout)

    def _settle(self, fetch: Fetch, state: str) -> None:
        if state == "DONE":
            if isinstance(fetch.staging, _StagedPages):
                fetch.staging.copy_heads_into(self.pool, fetch.dst_page_ids, fetch.heads)
            self._release_handle(fetch)
            self._complete(fetch)
        elif state == "ERR":
            self._fail(fetch, "NIXL READ failed", Failure.TRANSPORT)

    def _progress(self) -> None:
        for fetch in list(self._fetches.values()):
            if fetch.state == READING:
                self._settle(fetch, self._check(fetch))
            elif fetch.state == DRAINING:
                if self._check(fetch) != "PROC" and self._release_handle(fetch):
                    self._end_drained(fetch)
                elif time.monotonic() > fetch.deadline + DRAIN_GRACE_S:
                    logger.error(
                        "NIXL READ for %s did not stop %.0fs after its deadline; reporting it "
                        "failed anyway",
                        fetch.transfer_id,
                        DRAIN_GRACE_S,
                    )
                    self._abandoned.append((fetch.handle, fetch.staging))
                    fetch.handle = fetch.staging = None
                    self._end_drained(fetch)

    def progressing_silently(self) -> bool:
        return any(f.state in (READING, DRAINING) for f in self._fetches.values())

    def _stop_writes(self, fetch: Fetch) -> bool:
        # Releasing a handle cancels its READ; NIXL refuses when it cannot, and the fetch then
        # drains until the READ ends.
        return self._release_handle(fetch)

    def _close_backend(self) -> None:
        self._registered.deregister()

    def _check(self, fetch: Fetch) -> str:
        try:
            return self._agent.check_xfer_state(fetch.handle)
        except Exception as exc:
            logger.warning("NIXL transfer state of %s: %s", fetch.transfer_id, exc)
            return "ERR"

    def _release_handle(self, fetch: Fetch) -> bool:
        if fetch.handle is not None:
            try:
                self._agent.release_xfer_handle(fetch.handle)
            except Exception as exc:
                logger.info("NIXL could not release the READ of %s yet: %s", fetch.transfer_id, exc)
                return False
            fetch.handle = None
        if isinstance(fetch.staging, _StagedPages):  # nothing writes it any more
            fetch.staging.deregister()
            fetch.staging = None
        return True

    def _remove_agent(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            logger.info("NIXL could not remove remote agent %s: %s", name, exc)
