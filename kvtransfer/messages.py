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

A decode worker that prefills a prompt itself may fetch the prompt's leading pages from a
prefill worker that holds them, in its pool or the KV tiers below it, by their page hashes
(ZMQ only)::

    PrefixRequest(tid, hashes, tokens) ──▶    the sender's owner pins what it holds of them
                                ◀─────────    PrefixOffer(tid, pages): the run it holds, from the
                                              first page, each page's hash, parent and tokens
                                ◀─────────    PageData as for a FetchRequest, for those pages
                                ◀─────────    TransferFailed(tid, reason) if it holds none
    ReleasePages(tid, ok)       ─────────▶    the sender unpins them

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


@message("kv.prefix_request")
@dataclass(slots=True)
class PrefixRequest(Message):
    """Asks for the pages of a prompt's prefix, by their chained page hashes (in order; the
    first one's parent is ``parent``, None for the prompt's first page), with the prompt's
    tokens of those pages (``page_size`` each), so that the sender confirms a hit as its prefix
    cache and its tiers do, never by a hash alone. Every KV head the sender's pages hold."""

    transfer_id: str
    parent: int | None
    page_hashes: list[int]
    token_ids: list[int]


@dataclass(slots=True)
class OfferedPage:
    """One page of a prefix offer: what it is filed under where it is, and where that is
    (``pool``, ``host``, ``disk``)."""

    page_hash: int
    parent: int | None
    token_ids: list[int]
    tier: str


@message("kv.prefix_offer")
@dataclass(slots=True)
class PrefixOffer(Message):
    """The run of the pages asked for that the sender holds, from the first one asked (at least
    one); PageData for exactly these pages follows."""

    transfer_id: str
    instance_id: str  # the answering sender, which must be the one that was handshaken
    pages: list[OfferedPage]


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
