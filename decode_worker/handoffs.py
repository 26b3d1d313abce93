"""The decode side of a handoff: a prompt's pages reserved, fetched, then admitted or given up.

A prompt prefilled elsewhere comes as ``HandoffPart``s (pages its earlier chunks completed), then
its ``Handoff`` (the first token, and the pages no part brought). Each part reserves the pages it
brings, no more: what a part claims of the rest of the prompt (``num_prompt_tokens``) only bounds
where later parts may end, and the handoff reserves the pages no part brought. A
``PendingHandoff`` holds the pages until no fetch of them is running::

    part 0 ──▶ PARTS ──handoff, parts add up──▶ HANDED OFF ──fetches end──▶ admitted
    handoff offering every page ──────────────▶ HANDED OFF ──a fetch failed──▶ prefilled here
    PARTS ──handoff, parts do not add up──▶ prefilled here
    PARTS, HANDED OFF ──discarded──▶ DISCARDED ──fetches end──▶ pages freed

- Part k starts its fetch if it follows on from the parts before it. One out of order, past
  the prompt's end, without free pages, or whose fetch fails drops the parts at once (their
  pages freed once no fetch writes them); the handoff then has the prompt prefilled here. A
  part other than part 0 with none held is ignored.
- A handoff offering every page (``first_page`` 0) discards the parts held and reserves afresh;
  with no free pages the prompt is prefilled here. Bad sampling params fail the request (not
  retryable), bad transfer params too (retryable).
- Discarded: the router aborts the request or re-dispatches it here; before the handoff also
  when the prefill worker withdraws the parts, or the handoff is overdue: it is due by the end
  of the latest part's lease (the sender hands off within a chunk of its last part, long before
  that), and never more than ``PARTS_TIMEOUT_S`` after the latest part, whatever lease a part
  claims. Running fetches are aborted, and the pages freed only once the receiver reports the
  last one ended.
- A handoff or part 0 of a request known here (held, pending, aborted in the last
  ``ABORT_MEMORY_S``) is dropped before anything is reserved: an abort or a re-dispatch can
  overtake it. (The worker has checked each message against its own limits before all this.)

Called by one thread at a time: the decode worker's main loop between steps, and during a long
step its step helper, which accepts handoffs and parts as they come (``poll``, which admits, is
the main loop's alone). It reserves, frees and admits through ``Reservations`` (the
``DecodeScheduler``), fetches through a ``KVReceiver``, and reaches the router only through the
callables it is given.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from common.engine.sequence import Sequence
from common.kv_layout import pages_for
from common.metrics import KV_HANDOFF_SECONDS, KV_PAGES_RECEIVED, KV_TRANSFER_FALLBACKS
from common.protocol import Handoff, HandoffPart
from common.sampling_params import SamplingParams
from kvtransfer import KVReceiver, TransferError, TransferParams, TransferResult

logger = logging.getLogger(__name__)

# An abort can overtake its request's handoff (they travel on different sockets); aborted ids
# are remembered this long so a late handoff is dropped, not served.
ABORT_MEMORY_S = 120.0
# The longest a part's pages wait for their handoff, however long the part's lease (the sender
# vanished, or a part came from no real prefill): the handoff follows the last part within one
# prefill chunk.
PARTS_TIMEOUT_S = 60.0


class Reservations(Protocol):
    """What handoffs need of the decode scheduler (``DecodeScheduler`` is one)."""

    page_size: int

    def reserve(self, num_prompt_tokens: int) -> list[int] | None: ...
    def drop_reservation(self, page_ids: list[int]) -> None: ...
    def admit_prefilled(self, seq: Sequence, page_ids: list[int]) -> None: ...
    def holds(self, request_id: str) -> bool: ...


@dataclass(slots=True)
class PendingHandoff:
    """A prompt whose pages are on their way; it joins the batch once every fetch has ended."""

    request_id: str
    dst_page_ids: list[int]  # pages reserved so far: the parts' (in order), then the handoff's
    num_prompt_pages: int  # the prompt's pages, as the parts claim (the handoff's own count wins)
    handoff_due: float  # the clock's time by which the parts' handoff must come
    fetches: set[str] = field(default_factory=set)  # transfer ids still being fetched
    num_parts: int = 0  # parts whose fetch was started
    next_page: int = 0  # the first prompt page no part has brought
    handoff: Handoff | None = None  # the last word from the prefill worker, once here
    seq: Sequence | None = None  # prompt + first token, built from the handoff
    error: str | None = None  # why the pages will not all arrive: prefill the prompt here
    aborted: bool = False


class Handoffs:
    """Every prompt whose pages are reserved here and not yet settled, and the ids aborted
    lately.

    ``checked_params(request_id, params)``: the handoff's sampling params, or None once the router
    has been told they are bad. ``admit(seq)``: queue a prompt to prefill here (False once the
    router has been told it cannot be). ``fail(request_id, error, retryable)``: tell the router
    the request failed here. ``clock``: monotonic seconds, for the timeouts.
    ``adapter_namespace(lora_name)``: the prefix-cache namespace of a LoRA adapter this worker
    holds (``ValueError`` where it holds none of that name); None: it serves the base model alone.
    """

    def __init__(
        self,
        receiver: KVReceiver,
        scheduler: Reservations,
        *,
        checked_params: Callable[[str, SamplingParams], SamplingParams | None],
        admit: Callable[[Sequence], bool],
        fail: Callable[[str, str, bool], None],
        fetch_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        adapter_namespace: Callable[[str], str] | None = None,
        other_results: Callable[[TransferResult], object] | None = None,
    ) -> None:
        self.receiver = receiver
        # Where the fetches' results that are not a handoff's go (a prefix fetch's).
        self._other_results = other_results
        self._adapter_namespace = adapter_namespace
        self.scheduler = scheduler
        self.fetch_timeout = fetch_timeout
        self._checked_params = checked_params
        self._admit = admit
        self._fail = fail
        self._clock = clock
        self._pending: dict[str, PendingHandoff] = {}
        self._fetching: dict[str, PendingHandoff] = {}  # transfer id -> whose pages it brings
        self._aborted: OrderedDict[str, float] = OrderedDict()  # request id -> clock()
        self._next_parts_check = 0.0

    def num_pending(self) -> int:
        """Prompts waiting for their pages (or their handoff)."""
        return len(self._pending)

    def progress(self) -> dict[str, int]:
        """Each prompt waiting here, with a count that grows as its pages come: pages reserved
        for it, fetches ended, and its handoff once here."""
        return {
            request_id: len(pending.dst_page_ids)
            + pending.num_parts
            - len(pending.fetches)
            + (pending.handoff is not None)
            for request_id, pending in self._pending.items()
        }

    def remember_abort(self, request_id: str) -> None:
        """The router aborted ``request_id``: a handoff for it that comes later is dropped."""
        self._aborted[request_id] = self._clock()

    def forget_abort(self, request_id: str) -> None:
        """The router sent ``request_id`` here again: its latest word wins over an abort."""
        self._aborted.pop(request_id, None)

    def accept_part(self, part: HandoffPart) -> None:
        """Leading pages of a prompt still being prefilled: part 0 reserves the whole prompt's
        pages; each part in order starts its fetch, one out of order records an error."""
        request_id = part.request_id
        pending = self._pending.get(request_id)
        if pending is None:
            if part.part_index != 0 or self._known(request_id):
                return  # an earlier part was not taken: the handoff will say what to do
            num_pages = pages_for(part.num_prompt_tokens, self.scheduler.page_size)
            pending = PendingHandoff(request_id, [], num_pages, self._clock())
        elif pending.handoff is not None:
            return  # a part after the handoff: nothing to gain
        transfer = part.transfer
        end = part.first_page + len(transfer.page_ids)
        if part.part_index != pending.num_parts or part.first_page != pending.next_page:
            problem = (f"part {part.part_index} from page {part.first_page} arrived after "
                       f"{pending.num_parts} parts and {pending.next_page} pages")  # fmt: skip
        elif not transfer.page_ids or end > pending.num_prompt_pages:
            problem = f"part ends at page {end} of {pending.num_prompt_pages}"
        else:
            problem = None
        pages = None if problem else self._reserve_pages(len(transfer.page_ids))
        if pages is None:
            logger.info("dropping %s's parts: %s", request_id, problem or "no free pages")
            self._discard(pending)
            return
        self._pending[request_id] = pending
        pending.dst_page_ids.extend(pages)
        # The sender keeps a part's pages for its lease, and hands off within a chunk of its
        # last part: the handoff is due by then, or after a fetch's timeout if that is longer,
        # and never after PARTS_TIMEOUT_S (a lease of an hour holds nothing here for an hour).
        lease_left = transfer.lease_deadline - time.time()
        pending.handoff_due = self._clock() + min(
            max(lease_left, self.fetch_timeout), PARTS_TIMEOUT_S
        )
        if self._start_fetch(pending, part.transfer_id, transfer, pages):
            pending.num_parts += 1
            pending.next_page = end
        else:
            self._discard(pending)

    def _adapter_problem(self, handoff: Handoff) -> str | None:
        """Why this worker cannot continue ``handoff``'s KV (a LoRA adapter it does not hold,
        or holds with other weights), or None."""
        name = handoff.lora_name
        if name is None:
            if handoff.cache_namespace:
                return f"a base-model handoff in cache namespace {handoff.cache_namespace!r}"
            return None
        if self._adapter_namespace is None:
            return f"this decode worker serves no LoRA adapters, and the KV is under {name!r}"
        try:
            namespace = self._adapter_namespace(name)
        except ValueError as exc:
            return f"this decode worker does not hold the KV's adapter: {exc}"
        if namespace != handoff.cache_namespace:
            return f"this decode worker holds LoRA adapter {name!r} with other weights"
        return None

    def accept_handoff(self, handoff: Handoff) -> None:
        """The prefill worker's last word: fetch the pages no part brought and admit the prompt
        once every page is in, or prefill it here (or fail it) as the module docstring says."""
        request_id = handoff.request_id
        pending = self._pending.get(request_id)
        if pending is not None and pending.handoff is not None:
            logger.info("dropping a second handoff for %s", request_id)
            return
        if pending is None and self._known(request_id):
            return
        params = self._checked_params(request_id, handoff.params)
        if params is None:
            if pending is not None:
                self._discard(pending)
            return
        adapter_problem = self._adapter_problem(handoff)
        if adapter_problem is not None:
            # Never computed on under other weights: the router hears why.
            logger.warning("refusing the handoff of %s: %s", request_id, adapter_problem)
            if pending is not None:
                self._discard(pending)
            self._fail(request_id, adapter_problem, False)
            return
        seq = Sequence.from_prompt(request_id, handoff.prompt_token_ids, params)
        seq.lora_name, seq.cache_namespace = handoff.lora_name, handoff.cache_namespace
        seq.token_ids.append(handoff.first_token.token_id)
        seq.num_cached_tokens = handoff.num_cached_tokens
        num_pages = pages_for(seq.num_prompt_tokens, self.scheduler.page_size)
        if handoff.first_page == 0 and pending is not None:
            self._discard(pending)  # every page is offered again: the parts are not needed
            pending = None
        if handoff.first_page > 0:
            problem = _parts_problem(pending, handoff, num_pages)
            if problem is not None:
                logger.warning("%s's early pages are not all here (%s); prefilling it here",
                               request_id, problem)  # fmt: skip
                if pending is not None:
                    self._discard(pending)
                self._prefill_locally(seq)
                return
        try:
            transfer = handoff.transfer
            if len(transfer.page_ids) != num_pages - handoff.first_page:
                raise TransferError(
                    f"{len(transfer.page_ids)} pages offered after page {handoff.first_page} "
                    f"for a prompt that needs {num_pages}"
                )
        except TransferError as exc:
            if pending is not None:
                self._discard(pending)
            self._fail(request_id, f"bad handoff: {exc}", True)  # retryable
            return
        # The pages no part brought (all of them without parts).
        pages = self._reserve_pages(num_pages - handoff.first_page)
        if pages is None:
            logger.warning("no room for %s's %d pages; prefilling it here", request_id,
                           num_pages - handoff.first_page)  # fmt: skip
            if pending is not None:
                self._discard(pending)
            self._prefill_locally(seq)
            return
        if pending is None:
            pending = PendingHandoff(request_id, [], num_pages, self._clock())
            self._pending[request_id] = pending
        pending.dst_page_ids.extend(pages)
        pending.handoff, pending.seq = handoff, seq
        self._start_fetch(pending, request_id, transfer, pending.dst_page_ids[handoff.first_page :])
        self._settle(pending)

    def withdraw_parts(self, request_id: str) -> None:
        """The prefill worker will not hand ``request_id`` off after all (it was aborted there,
        or its first token ended it): drop the parts held for it. Only parts: a request the
        router has since re-dispatched here is the router's to stop."""
        pending = self._pending.get(request_id)
        if pending is not None and pending.handoff is None:
            self._discard(pending)

    def discard(self, request_id: str) -> bool:
        """Stop waiting for ``request_id``'s pages, if it has any coming; whether it had."""
        pending = self._pending.get(request_id)
        if pending is None:
            return False
        self._discard(pending)
        return True

    def poll(self) -> None:
        """Settle the fetches the receiver reports ended, and drop parts whose handoff is long
        overdue. Called every iteration of the worker's loop."""
        for result in self.receiver.poll():
            if result.transfer_id in self._fetching or self._other_results is None:
                self._on_fetched(result)
            else:
                self._other_results(result)
        self._expire_parts()

    # -- internals ------------------------------------------------------------------------------

    def _known(self, request_id: str) -> bool:
        """Whether a handoff's request is already served here or was aborted: an abort or a
        re-dispatch can overtake a handoff (they travel on different sockets)."""
        now = self._clock()
        while self._aborted and next(iter(self._aborted.values())) < now - ABORT_MEMORY_S:
            self._aborted.popitem(last=False)
        known = (
            request_id in self._pending
            or request_id in self._aborted
            or self.scheduler.holds(request_id)
        )
        if known:
            logger.info("dropping a late handoff for %s", request_id)
        return known

    def _start_fetch(
        self,
        pending: PendingHandoff,
        transfer_id: str,
        transfer: TransferParams,
        dst: list[int],
    ) -> bool:
        try:
            self.receiver.start_fetch(transfer_id, transfer, dst, self.fetch_timeout)
        except TransferError as exc:
            pending.error = pending.error or f"bad handoff: {exc}"
            return False
        self._fetching[transfer_id] = pending
        pending.fetches.add(transfer_id)
        return True

    def _on_fetched(self, result: TransferResult) -> None:
        pending = self._fetching.pop(result.transfer_id, None)
        if pending is None:
            return
        pending.fetches.discard(result.transfer_id)
        if not result.ok:
            pending.error = pending.error or f"fetching pages failed ({result.error})"
            if pending.handoff is None and not pending.aborted:
                # Parts only: their pages are not held for a handoff that will prefill here.
                logger.info("dropping %s's parts: %s", pending.request_id, pending.error)
                self._discard(pending)
                return
        elif not pending.aborted:
            KV_PAGES_RECEIVED.inc(result.num_pages)
        self._settle(pending)

    def _settle(self, pending: PendingHandoff) -> None:
        """Once no fetch of ``pending`` is running: free its pages if it was dropped, admit it
        if its handoff came and every page arrived, prefill it here if one could not."""
        if pending.fetches:
            return
        if pending.aborted:
            self.scheduler.drop_reservation(pending.dst_page_ids)
            return
        if pending.handoff is None or pending.seq is None:
            return  # the parts are in; the handoff has not come yet
        del self._pending[pending.request_id]
        seq = pending.seq
        if pending.error is not None:
            logger.warning("%s: %s; prefilling it here", seq.request_id, pending.error)
            self.scheduler.drop_reservation(pending.dst_page_ids)
            self._prefill_locally(seq)
            return
        if pending.handoff.prefill_done_at is not None:
            seq.handoff_wait_s = max(0.0, time.time() - pending.handoff.prefill_done_at)
            KV_HANDOFF_SECONDS.observe(seq.handoff_wait_s)
        try:
            self.scheduler.admit_prefilled(seq, pending.dst_page_ids)
        except ValueError as exc:
            self._fail(seq.request_id, str(exc), False)  # not retryable

    def _discard(self, pending: PendingHandoff) -> None:
        """Stop waiting for ``pending``'s pages; they are freed once no fetch writes them."""
        self._pending.pop(pending.request_id, None)
        pending.aborted = True
        for transfer_id in pending.fetches:
            self.receiver.abort(transfer_id)  # reported through receiver.poll()
        self._settle(pending)

    def _expire_parts(self) -> None:
        now = self._clock()
        if now < self._next_parts_check:
            return
        self._next_parts_check = now + 1.0
        for pending in list(self._pending.values()):
            if pending.handoff is None and now > pending.handoff_due:
                logger.warning("%s's handoff is overdue; dropping its parts", pending.request_id)
                self._discard(pending)

    def _reserve_pages(self, num_pages: int) -> list[int] | None:
        """``num_pages`` free pages reserved (none for 0), or None if they are not free."""
        if num_pages == 0:
            return []
        return self.scheduler.reserve(num_pages * self.scheduler.page_size)

    def _prefill_locally(self, seq: Sequence) -> None:
        KV_TRANSFER_FALLBACKS.inc()
        seq.page_ids = []
        seq.num_computed_tokens = 0
        self._admit(seq)


def _parts_problem(pending: PendingHandoff | None, handoff: Handoff, num_pages: int) -> str | None:
    """Why the parts held for ``handoff`` cannot be completed by it, or None."""
    if pending is None:
        return "none of its parts were taken"
    if pending.error is not None:
        return pending.error
    if (pending.num_parts, pending.next_page) != (handoff.num_parts, handoff.first_page):
        return (
            f"{pending.num_parts} parts up to page {pending.next_page} here, the handoff "
            f"counts {handoff.num_parts} up to page {handoff.first_page}"
        )
    if pending.num_prompt_pages != num_pages:
        return f"the parts claimed {pending.num_prompt_pages} pages for a prompt of {num_pages}"
    return None
