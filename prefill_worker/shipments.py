"""The prefill side of a handoff: which pages go to which decode worker, under which lease.

A request admitted here is *expected* by the decode worker the router chose for it (its
``PrefillRequest`` names the endpoint) until its first token is sampled::

    EXPECTED ──a chunk completed pages──▶ EXPECTED, one more part shipped
       │
       ├──first token, the request goes on──▶ HANDED OFF ──its lease's id from poll──▶ released
       └──first token ended it, or abort────▶ WITHDRAWN

- EXPECTED → EXPECTED (``ship_parts``): the prompt pages completed since the last part are
  published as one more part, under a lease that holds its own reference on them, and a
  ``HandoffPart`` is pushed. A part that cannot be published or pushed marks the prompt's parts
  broken: none follows, and the handoff offers every page instead.
- EXPECTED → HANDED OFF (``on_first_token``): the pages no part shipped (all of them if the parts
  broke) are published and a ``Handoff`` is pushed; the sequence keeps its pages until the
  sender returns the lease's id. If that push fails, the handoff's lease is aborted, the parts
  withdrawn, and the router told the request failed (retryable); if publishing fails (a
  tensor-parallel rank did not answer), likewise, and the pages are released at once.
- EXPECTED → WITHDRAWN (``on_first_token`` of a finished sequence, ``withdraw`` on abort): each
  part's lease is aborted and, if any part went out, the decode worker is pushed an
  ``AbortRequest`` so it frees what it reserved.
- Leases end in ``poll``: a part's id frees the lease's reference, a handoff's id releases the
  sequence's pages. ``abort_handoff`` ends a handoff's lease early (the client went away).

Owned and called by the prefill worker's main loop, one thread. It publishes through a
``KVSender``, takes and frees lease references through ``LeasedPages`` (the ``PageManager``), and
reaches the decode workers and the router only through the callables it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from common.engine.sequence import Sequence
from common.messages import Message
from common.metrics import KV_PAGES_SENT, REQUESTS
from common.protocol import AbortRequest, Handoff, HandoffPart, PrefillRequest
from common.service.worker_base import sample_to_wire
from kvtransfer import KVSender

logger = logging.getLogger(__name__)


class LeasedPages(Protocol):
    """What shipping needs of the page books (``PageManager`` is one)."""

    page_size: int

    def acquire(self, page_ids: list[int]) -> None: ...

    def free(self, page_ids: list[int]) -> None: ...


@dataclass(slots=True)
class ShippedParts:
    """The parts of one prompt shipped while it was still being prefilled."""

    num_pages: int = 0  # leading prompt pages shipped so far
    transfer_ids: list[str] = field(default_factory=list)  # one per part, in order
    broken: bool = False  # a part could not be sent: the handoff offers every page instead


class Shipments:
    """Where each expected request's handoff goes, the parts shipped for it, and the leases
    still out.

    ``release(seq)``: free the pages a handed-off sequence still holds (the prefill scheduler's
    ``release``). ``push(endpoint, msg)``: send ``msg`` to the decode worker at ``endpoint``
    without blocking; False if it is not taking handoffs. ``fail(request_id, error,
    retryable)``: tell the router the request failed here.
    """

    def __init__(
        self,
        sender: KVSender,
        pages: LeasedPages,
        *,
        release: Callable[[Sequence], None],
        push: Callable[[str, Message], bool],
        fail: Callable[[str, str, bool], None],
        lease_seconds: float,
    ) -> None:
        self.sender = sender
        self.pages = pages
        self.lease_seconds = lease_seconds
        self._release = release
        self._push = push
        self._fail = fail
        self._targets: dict[str, PrefillRequest] = {}  # request id -> where its handoff goes
        self._shipped: dict[str, Sequence] = {}  # request id -> sequence holding leased pages
        self._parts: dict[str, ShippedParts] = {}  # request id -> parts shipped so far
        self._part_pages: dict[str, list[int]] = {}  # part transfer id -> pages its lease holds

    def num_handed_off(self) -> int:
        """Requests handed off whose pages are still leased."""
        return len(self._shipped)

    def expect(self, request: PrefillRequest) -> None:
        """``request`` was admitted here: its pages go where it says once it has them."""
        self._targets[request.request_id] = request

    def ship_parts(self, seqs: Iterable[Sequence]) -> None:
        """After a step: ship the pages each expected sequence completed since its last part."""
        for seq in seqs:
            target = self._targets.get(seq.request_id)
            if target is not None:  # still prefilling
                self._ship_part(seq, target)

    def on_first_token(self, seq: Sequence, done_at: float) -> None:
        """``seq`` left the batch with its first token (``done_at``: the wall-clock time its last
        chunk ended): hand it off, or take back its parts if that token ended it."""
        target = self._targets.pop(seq.request_id)
        parts = self._parts.pop(seq.request_id, None)
        if seq.finish_reason is not None:
            if parts is not None:
                self._withdraw(seq.request_id, parts, target)
            return  # its first token ended it: nothing to hand off
        self._hand_off(seq, target, done_at, parts)

    def withdraw(self, request_id: str) -> None:
        """``request_id`` was aborted: forget where it was going and take back its parts."""
        target = self._targets.pop(request_id, None)
        parts = self._parts.pop(request_id, None)
        if parts is not None and target is not None:
            self._withdraw(request_id, parts, target)

    def abort_handoff(self, request_id: str) -> None:
        """End a handed-off request's lease early; its pages come back through ``poll``."""
        if request_id in self._shipped:
            self.sender.abort(request_id)

    def poll(self) -> None:
        """Free the pages of every lease the sender reports ended. Called every iteration of the
        worker's loop."""
        for transfer_id in self.sender.poll():
            part_pages = self._part_pages.pop(transfer_id, None)
            if part_pages is not None:
                self.pages.free(part_pages)  # the lease's reference
                continue
            seq = self._shipped.pop(transfer_id, None)
            if seq is not None:
                self._release(seq)

    # -- internals ------------------------------------------------------------------------------

    def _ship_part(self, seq: Sequence, target: PrefillRequest) -> None:
        """Publish the prompt pages ``seq`` completed since its last part, if any."""
        parts = self._parts.setdefault(seq.request_id, ShippedParts())
        num_full = seq.num_computed_tokens // self.pages.page_size
        if parts.broken or num_full <= parts.num_pages:
            return
        pages = seq.page_ids[parts.num_pages : num_full]
        transfer_id = f"{seq.request_id}/part{len(parts.transfer_ids)}"
        try:
            transfer = self.sender.publish(transfer_id, pages, self.lease_seconds)
        except Exception as exc:  # e.g. a request id that collides with a part's id
            logger.warning("cannot ship part of %s early: %s", seq.request_id, exc)
            parts.broken = True
            return
        # The lease's own reference: the pages outlive a preemption or abort of the sequence
        # until the decode worker has them (or the lease ends).
        self.pages.acquire(pages)
        self._part_pages[transfer_id] = pages
        part = HandoffPart(
            request_id=seq.request_id,
            part_index=len(parts.transfer_ids),
            first_page=parts.num_pages,
            num_prompt_tokens=seq.num_prompt_tokens,
            transfer_id=transfer_id,
            transfer=transfer,
        )
        if not self._push(target.handoff_endpoint, part):
            self.sender.abort(transfer_id)  # its pages come back through sender.poll()
            parts.broken = True
            return
        parts.transfer_ids.append(transfer_id)
        parts.num_pages = num_full
        KV_PAGES_SENT.inc(len(pages))

    def _withdraw(self, request_id: str, parts: ShippedParts, target: PrefillRequest) -> None:
        """Take back the parts of a prompt that will not be handed off (aborted, or its first
        token ended it): end their leases, and tell the decode worker to drop what it holds."""
        for transfer_id in parts.transfer_ids:
            self.sender.abort(transfer_id)
        if parts.transfer_ids:
            self._push(target.handoff_endpoint, AbortRequest(request_id))

    def _hand_off(
        self,
        seq: Sequence,
        target: PrefillRequest,
        done_at: float,
        parts: ShippedParts | None,
    ) -> None:
        if parts is None or parts.broken:
            first_page, num_parts = 0, 0  # the decode worker drops any parts it holds
        else:
            first_page, num_parts = parts.num_pages, len(parts.transfer_ids)
        pages = list(seq.page_ids[first_page:])
        try:
            transfer = self.sender.publish(seq.request_id, pages, self.lease_seconds)
        except ValueError as exc:
            # A tensor-parallel rank that did not publish (kvtransfer/tp_group.py): nothing is
            # leased, so the pages go back now, and another pair can serve the request.
            logger.warning("cannot hand %s off: %s", seq.request_id, exc)
            if parts is not None:
                self._withdraw(seq.request_id, parts, target)
            self._release(seq)
            self._fail(seq.request_id, f"its KV pages could not be published: {exc}", True)
            return
        self._shipped[seq.request_id] = seq
        handoff = Handoff(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            params=target.params,
            first_token=sample_to_wire(seq.samples[0]),
            transfer=transfer,
            num_cached_tokens=seq.num_cached_tokens,
            prefill_done_at=done_at,
            first_page=first_page,
            num_parts=num_parts,
            lora_name=seq.lora_name,
            cache_namespace=seq.cache_namespace,
        )
        if not self._push(target.handoff_endpoint, handoff):
            # The decode worker is not taking handoffs; the router will see it go silent.
            self.sender.abort(seq.request_id)
            if parts is not None:
                self._withdraw(seq.request_id, parts, target)
            self._fail(
                seq.request_id,
                f"decode worker {target.decode_worker_id} unreachable",
                True,  # retryable
            )
            return
        KV_PAGES_SENT.inc(len(pages))
        REQUESTS.labels(outcome="handed_off").inc()
