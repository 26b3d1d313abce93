"""Side-channel messages between a KV sender (ROUTER) and its receivers (one DEALER each).

    receiver                                  sender
    HandshakeRequest            ─────────▶    (once per sender, cached)
                                ◀─────────    HandshakeReply: version, layout, NIXL agent
    FetchRequest(tid)           ─────────▶
      zmq:                      ◀─────────    PageData header + one frame per page (+ scales),
                                              in messages of a few MB; of the heads asked
                                              for, when that is not every head
      nixl:                     ◀─────────    FetchReady, then the receiver READs the pages
                                ◀─────────    TransferFailed(tid, reason) if it cannot serve
    ReleasePages(tid, ok)       ─────────▶    the sender may free the pages

Between tensor-parallel workers each decode rank fetches its heads from the prefill ranks that
hold them, and only the decode group's rank 0 sends ReleasePages, to prefill rank 0, once every
decode rank holds its copy (``kvtransfer/tp_group.py``).

The handshake messages must keep their shape across protocol versions, their ``KVLayout``
included: they are what tells two workers of different versions apart with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.kv_layout import KVLayout
from common.messages import Message, message


@dataclass(slots=True)
class NixlAgentInfo:
    """What a receiver needs to READ from a sender's registered pool."""

    agent_name: str
    metadata: bytes  # nixl_agent.get_agent_metadata()
    data_addr: int  # address of page 0 of the pool's data; page i is at + i * page_nbytes
    scale_addr: int | None  # same for the pages' scales; None for pools without scales
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int


@message("kv.handshake_request")
@dataclass(slots=True)
class HandshakeRequest(Message):
    protocol_version: int
    engine_id: str
    backend: str
    layout: KVLayout


@message("kv.handshake_reply")
@dataclass(slots=True)
class HandshakeReply(Message):
    protocol_version: int
    engine_id: str
    instance_id: str  # new for every sender object: tells a restarted sender apart
    backend: str
    layout: KVLayout
    num_pages: int
    nixl: NixlAgentInfo | None = None


@message("kv.fetch_request")
@dataclass(slots=True)
class FetchRequest(Message):
    """Asks for every page published under ``transfer_id``: model KV heads ``first_kv_head``
    onwards, ``num_kv_heads`` of them (a tensor-parallel rank's share), or every head the
    sender's pages hold (None)."""

    transfer_id: str
    first_kv_head: int | None = None
    num_kv_heads: int | None = None


@message("kv.fetch_ready")
@dataclass(slots=True)
class FetchReady(Message):
    """NIXL: the pages stay pinned until ReleasePages; READ them now."""

    transfer_id: str
    instance_id: str  # the answering sender, which must be the one that was handshaken


@message("kv.page_data")
@dataclass(slots=True)
class PageData(Message):
    """ZMQ: header of one message of an answer: ``num_pages`` page frames, then (quantised pools)
    as many scale frames, for the transfer's pages ``first_page`` onwards (in context order)."""

    transfer_id: str
    instance_id: str  # the answering sender, which must be the one that was handshaken
    first_page: int
    num_pages: int
    page_nbytes: int
    scale_nbytes: int  # bytes of each scale frame; 0 when the pool has no scales


@message("kv.release_pages")
@dataclass(slots=True)
class ReleasePages(Message):
    """The receiver is done with the pages: it holds a copy (``ok``) or has given up."""

    transfer_id: str
    ok: bool


@message("kv.transfer_failed")
@dataclass(slots=True)
class TransferFailed(Message):
    """The sender cannot serve (unknown or expired transfer, aborted, bad request)."""

    transfer_id: str
    reason: str
