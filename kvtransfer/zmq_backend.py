"""KV transfer over ZeroMQ: the sender answers a fetch with the pages as zero-copy frames.

The answer is a run of multipart messages, each a msgpack ``PageData`` header naming which of
the request's pages it carries, then one frame per page sent straight from the pool's memory,
then (quantised pools) one frame per page of scales. The receiver has ZeroMQ receive each frame
straight into its destination page (``recv_into``): out of the kernel's socket buffer into
ZeroMQ's message buffer, then into the pool, with no Python frame or tensor made per page.

Why messages of about ``MESSAGE_BYTES`` rather than one per request: ZeroMQ hands a multipart
message over only once all of it has arrived, so with one message per request the receiver
copies nothing until the last byte is in, and every byte sits in a freshly allocated (page-
faulting) ZeroMQ buffer meanwhile. Messages of a few pages let the receiver copy one into the
pool while the next crosses the socket, and keep its buffers small and reused: on a 2-core host
over loopback, 256 MB moved ~1.5x faster in 2 MB messages than in 128 MB ones.

One frame per page, not per run of adjacent pages: pages of a request are rarely adjacent in a
pool that has been in use, and a frame costs little next to a page.

A fetch of some of the pages' KV heads (between tensor-parallel ranks) gets frames of just those
heads: the sender gathers them into a contiguous copy (``head_slices.py``), which is then what
the frames point into; a receiver whose pages hold other heads besides takes the frames into
staging rows and writes them into its heads with one strided copy per tensor.
"""

from __future__ import annotations

import numpy as np
import torch
import zmq

from common.engine.kv_pool import KVPool
from kvtransfer.head_slices import as_pages, gather_heads, scatter_heads
from kvtransfer.messages import PageData, TransferFailed
from kvtransfer.metrics import Failure
from kvtransfer.receiver import REQUESTED, Fetch, SideChannelReceiver
from kvtransfer.sender import Lease, SideChannelSender
from kvtransfer.side_channel import Incoming

MESSAGE_BYTES = 2 << 20


class ZmqSender(SideChannelSender):
    backend = "zmq"

    def serves_prefixes(self) -> bool:
        return True

    def __init__(self, pool: KVPool, engine_id: str, host: str = "127.0.0.1", port: int = 0):
        super().__init__(pool, engine_id, host, port)
        self._tensors = [t for t in (pool.data, pool.scales) if t is not None]
        # Row i is page i's bytes: frames of a host pool are cut straight from these rows.
        self._host_rows = [
            _rows(t) for t in (pool.data, pool.scales) if t is not None and t.device.type == "cpu"
        ]

    def _serve(self, identity: bytes, lease: Lease, heads: range) -> None:
        layout = self.pool.layout
        page_nbytes, scale_nbytes = layout.slice_nbytes(len(heads))
        step = max(1, MESSAGE_BYTES // (page_nbytes + scale_nbytes))
        num_pages = lease.num_pages
        local = range(heads.start - layout.first_kv_head, heads.stop - layout.first_kv_head)
        loan_rows = lease.loan.rows() if lease.loan is not None else None
        if loan_rows is not None and len(local) != layout.num_kv_heads:
            self._channel.send(
                TransferFailed(lease.transfer_id, "a prefix is lent with every KV head"), identity
            )
            return
        for first in range(0, num_pages, step):
            chunk = lease.page_ids[first : first + step]
            if loan_rows is not None:  # a prefix loan's pages, wherever they are
                page_rows = [rows[first : first + step] for rows in loan_rows]
                chunk = page_rows[0]
            elif len(local) == layout.num_kv_heads:
                page_rows = self._page_rows(chunk)
            else:
                page_rows = [list(gather_heads(t, chunk, local).numpy()) for t in self._tensors]
            buffers = [row for rows in page_rows for row in rows]
            frames = [zmq.Frame(b, copy=False) for b in buffers[:-1]]
            # Only the very last frame of the answer is tracked: ZMQ releases frames in the
            # order they were queued, so once it is released no page is read any more.
            frames.append(zmq.Frame(buffers[-1], copy=False, track=first + step >= num_pages))
            header = PageData(
                transfer_id=lease.transfer_id,
                instance_id=self.instance_id,
                first_page=first,
                num_pages=len(chunk),
                page_nbytes=page_nbytes,
                scale_nbytes=scale_nbytes,
            )
            if not self._channel.send(header, identity, frames):
                return  # the receiver is gone or not reading; its fetch will time out
        trackers = lease.in_flight if isinstance(lease.in_flight, list) else []
        trackers.append(frames[-1].tracker)
        lease.in_flight = trackers

    def _still_reading(self, lease: Lease) -> bool:
        # ZMQ holds the page memory until the frames are handed to the kernel; after that a
        # rewrite of the pages can no longer change what the receiver gets.
        trackers = lease.in_flight
        return isinstance(trackers, list) and not all(t.done for t in trackers)

    def _page_rows(self, page_ids: list[int]) -> list[list]:
        """Each page's bytes (then any scales) as buffers ZMQ can send."""
        if self._host_rows:
            return [[rows[b] for b in page_ids] for rows in self._host_rows]
        # Device pools are staged through host memory: one gather and one copy per tensor.
        index = torch.tensor(page_ids, device=self.pool.device)
        return [list(_rows(t.index_select(0, index).cpu())) for t in self._tensors]


class ZmqReceiver(SideChannelReceiver):
    backend = "zmq"
    fetches_prefixes = True

    def __init__(self, pool: KVPool, engine_id: str):
        super().__init__(pool, engine_id)
        self._tensors = [t for t in (pool.data, pool.scales) if t is not None]
        # Row i is page i's bytes (a writable view) of a host pool: frames land straight in it.
        self._host_rows = [_rows(t) for t in self._tensors] if pool.device.type == "cpu" else []

    def _frames_allowed(self) -> tuple[type, ...]:
        return (PageData,)

    def _max_inbound_bytes(self) -> int:
        return self.pool.layout.page_nbytes

    def _on_reply(self, fetch: Fetch, incoming: Incoming) -> None:
        msg = incoming.msg
        if not isinstance(msg, PageData) or fetch.state != REQUESTED:
            self._reject(fetch.peer, f"dropped unexpected {type(msg).__name__}")
            return
        problem = self._page_data_problem(fetch, msg)
        if problem is None:
            dst = fetch.dst_page_ids[msg.first_page : msg.first_page + msg.num_pages]
            if fetch.heads == self.pool.layout.heads:
                problem = self._receive_pages(incoming, dst)
            else:
                problem = self._receive_heads(incoming, dst, fetch.heads)
        if problem is not None:
            self._reject(fetch.peer, f"dropped malformed page data: {problem}")
            # The sender answers a fetch once; a bad answer will not be followed by a good one.
            self._fail(fetch, f"malformed page data: {problem}", Failure.TRANSPORT)
            return
        fetch.pages_done += msg.num_pages
        if fetch.pages_done == len(fetch.dst_page_ids):
            self._complete(fetch)

    def _receive_pages(self, incoming: Incoming, dst: list[int]) -> str | None:
        """Each frame into its destination page (then any scales); a problem or None."""
        if self._host_rows:
            # ZeroMQ copies each frame from its own buffer into the page: no Python copy at all.
            return incoming.read_frames_into([rows[b] for rows in self._host_rows for b in dst])
        # Device pools are staged through host memory: one copy and one scatter per tensor.
        staged = [torch.empty((len(dst), t[0].nbytes), dtype=torch.uint8) for t in self._tensors]
        problem = incoming.read_frames_into([row.numpy() for rows in staged for row in rows])
        if problem is None:
            index = torch.tensor(dst, device=self.pool.device)
            for tensor, rows in zip(self._tensors, staged, strict=True):
                flat = tensor.view(torch.uint8).view(tensor.shape[0], -1)
                flat.index_copy_(0, index, rows.to(self.pool.device))
        return problem

    def _receive_heads(self, incoming: Incoming, dst: list[int], heads: range) -> str | None:
        """Frames of some of this pool's heads: staged, then written into those heads."""
        layout = self.pool.layout
        local = range(heads.start - layout.first_kv_head, heads.stop - layout.first_kv_head)
        sizes = layout.slice_nbytes(len(heads))
        staged = [
            torch.empty((len(dst), n), dtype=torch.uint8) for n in sizes[: len(self._tensors)]
        ]
        problem = incoming.read_frames_into([row.numpy() for rows in staged for row in rows])
        if problem is None:
            for tensor, rows in zip(self._tensors, staged, strict=True):
                scatter_heads(tensor, dst, local, as_pages(rows, tensor, len(heads)))
        return problem

    def _page_data_problem(self, fetch: Fetch, msg: PageData) -> str | None:
        layout = self.pool.layout
        total = len(fetch.dst_page_ids)
        if msg.first_page != fetch.pages_done or not 0 < msg.num_pages <= total - msg.first_page:
            return (
                f"pages {msg.first_page}..{msg.first_page + msg.num_pages} arrived after "
                f"{fetch.pages_done} of {total}"
            )
        page_nbytes, scale_nbytes = layout.slice_nbytes(len(fetch.heads))
        if (msg.page_nbytes, msg.scale_nbytes) != (page_nbytes, scale_nbytes):
            return (
                f"page of {msg.page_nbytes}+{msg.scale_nbytes} bytes, expected "
                f"{page_nbytes}+{scale_nbytes}"
            )
        return None


def _rows(tensor: torch.Tensor) -> np.ndarray:
    """A page-major host tensor as a (num_pages, bytes per page) uint8 array, no copy."""
    return tensor.view(torch.uint8).reshape(tensor.shape[0], -1).numpy()
