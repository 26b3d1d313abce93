"""The decode worker: continuous batching over handed-off and locally prefilled requests.

A ``Handoff`` from a prefill worker reserves pages for the prompt and starts a fetch; when the
pages arrive the request joins the running batch with its prompt already computed. A long
prompt's leading pages may come earlier, in ``HandoffPart``s sent after each of its chunks: the
first part reserves the whole prompt's pages, each part's fetch starts at once, and the handoff
then brings only the rest. If a fetch fails (the prefill worker died, the lease ran out) the
reserved pages are released and the prompt is prefilled here instead, so no request is lost. A
``DecodeRequest`` (a short prompt the router did not send to a prefill worker, or a migrated
request) is prefilled here from the start. Every sampled token streams to the router as a
``TokenDelta``.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from common.engine.scheduler import ScheduledSequence, SequenceOutput
from common.engine.sequence import Sequence
from common.messages import Message, ProtocolError, decode
from common.metrics import (
    BAD_MESSAGES,
    KV_HANDOFF_SECONDS,
    KV_PAGES_RECEIVED,
    KV_TRANSFER_FALLBACKS,
    REQUESTS,
)
from common.protocol import (
    AbortRequest,
    DecodeRequest,
    Handoff,
    HandoffPart,
    RegisterWorker,
)
from common.service.worker_base import WorkerService, run_worker, worker_parser
from kernels.sizes import ceil_div
from kvtransfer import TransferError, TransferParams, TransferResult, create_receiver

logger = logging.getLogger(__name__)

# Handoffs carry prompts; this bounds one frame well above any prompt a worker can hold.
_MAX_HANDOFF_BYTES = 64 << 20
# An abort can overtake its request's handoff (they travel on different sockets); aborted ids
# are remembered this long so a late handoff is dropped, not served.
_ABORT_MEMORY_S = 120.0
# Pages reserved by parts whose handoff never came (the prefill worker vanished and the router
# did not re-dispatch the request here) are given back after this long without news.
_PARTS_TIMEOUT_S = 300.0


@dataclass(slots=True)
class PendingHandoff:
    """A prompt whose pages are on their way; it joins the batch once every fetch has ended."""

    request_id: str
    dst_block_ids: list[int]  # the whole prompt's pages, reserved when the first news came
    fetches: set[str] = field(default_factory=set)  # transfer ids still being fetched
    num_parts: int = 0  # parts whose fetch was started
    next_page: int = 0  # the first prompt page no part has brought
    handoff: Handoff | None = None  # the last word from the prefill worker, once here
    seq: Sequence | None = None  # prompt + first token, built from the handoff
    error: str | None = None  # why the pages will not all arrive: prefill the prompt here
    aborted: bool = False
    updated: float = field(default_factory=time.monotonic)


class DecodeWorker(WorkerService):
    """pdserve decode worker"""

    role = "decode"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.receiver = create_receiver(args.kv_transfer, self.engine.pool, self.worker_id)
        self.fetch_timeout = args.kv_fetch_timeout
        self.handoffs = self.context.socket(zmq.PULL)
        self.auth.server(self.handoffs, "handoff")
        self.handoffs.setsockopt(zmq.LINGER, 0)
        self.handoffs.setsockopt(zmq.MAXMSGSIZE, _MAX_HANDOFF_BYTES)
        port = self.handoffs.bind_to_random_port(f"tcp://{args.host}")
        self.handoff_endpoint = f"tcp://{args.host}:{port}"
        self._pending: dict[str, PendingHandoff] = {}
        self._fetching: dict[str, PendingHandoff] = {}  # transfer id -> whose pages it brings
        self._aborted: OrderedDict[str, float] = OrderedDict()  # request id -> time.monotonic()
        self._next_parts_check = 0.0

    def registration(self) -> RegisterWorker:
        return self.base_registration(handoff_endpoint=self.handoff_endpoint)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, DecodeRequest):
            params = self.checked_params(msg.request_id, msg.params)
            if params is None:
                return
            # The router's latest word wins: a request it re-dispatches here (its prefill worker
            # was lost, or it migrated) replaces whatever this worker held under the same id,
            # even one it was just told to abort.
            self._aborted.pop(msg.request_id, None)
            self._drop_request(msg.request_id)
            seq = Sequence.from_prompt(msg.request_id, msg.prompt_token_ids, params)
            seq.token_ids.extend(msg.output_token_ids)  # a migrated request continues
            self.admit(seq)
        elif isinstance(msg, AbortRequest):
            self._aborted[msg.request_id] = time.monotonic()
            if self._drop_request(msg.request_id):
                REQUESTS.labels(outcome="abort").inc()
        else:
            logger.debug("decode worker ignores %s", type(msg).__name__)

    def poll_io(self) -> None:
        while True:
            try:
                frame = self.handoffs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = decode(frame, max_size=_MAX_HANDOFF_BYTES)
            except ProtocolError as exc:
                self._drop(str(exc))
                continue
            problem = self._size_problem(msg)
            if problem is not None:
                name = getattr(msg, "request_id", "?")
                self._drop(f"{type(msg).__name__} for {name!r}: {problem}")
            elif isinstance(msg, Handoff):
                self._accept_handoff(msg)
            elif isinstance(msg, HandoffPart):
                self._accept_part(msg)
            elif isinstance(msg, AbortRequest):
                self._withdraw_parts(msg.request_id)
            else:
                self._drop(f"unexpected {type(msg).__name__} on the handoff socket")
        for result in self.receiver.poll():
            self._on_fetched(result)
        self._expire_parts()

    def extra_sockets(self) -> list:
        return [self.handoffs, *self.receiver.poll_sockets()]

    def on_finished_step(
        self, batch: list[ScheduledSequence], outputs: list[SequenceOutput]
    ) -> None:
        self.send_deltas([self.delta(out.seq, len(out.new_samples)) for out in outputs])
        for out in outputs:
            if out.left_batch:
                REQUESTS.labels(outcome=out.seq.finish_reason.value).inc()

    def num_pending(self) -> int:
        return len(self._pending)

    def io_in_flight(self) -> bool:
        return self.receiver.progressing_silently()

    # -- handoffs -------------------------------------------------------------------------------

    def _size_problem(self, msg) -> str | None:
        """What in a handoff or part lies outside this worker's own limits (a token id beyond
        the vocabulary, a prompt longer than the context, pages it could never hold), or None.
        Checked before anything is reserved or computed for it."""
        vocab, max_len = self.engine.model_config.vocab_size, self.engine.max_model_len
        if isinstance(msg, HandoffPart):
            if not 1 <= msg.num_prompt_tokens < max_len:
                return f"a {msg.num_prompt_tokens}-token prompt (the context is {max_len})"
            if msg.part_index < 0 or msg.first_page < 0:
                return "a negative part index or page"
        elif isinstance(msg, Handoff):
            prompt = msg.prompt_token_ids
            if not 1 <= len(prompt) < max_len:
                return f"a {len(prompt)}-token prompt (the context is {max_len})"
            if not 0 <= msg.first_token.token_id < vocab or not all(0 <= t < vocab for t in prompt):
                return f"token ids outside the vocabulary [0, {vocab})"
            if not 0 <= msg.num_cached_tokens <= len(prompt):
                return f"{msg.num_cached_tokens} cached tokens of a {len(prompt)}-token prompt"
            if msg.first_page < 0 or msg.num_parts < 0:
                return "a negative first page or part count"
        return None

    def _known(self, request_id: str) -> bool:
        """Whether a handoff's request is already served here or was aborted: an abort or a
        re-dispatch can overtake a handoff (they travel on different sockets)."""
        now = time.monotonic()
        while self._aborted and next(iter(self._aborted.values())) < now - _ABORT_MEMORY_S:
            self._aborted.popitem(last=False)
        known = (
            request_id in self._pending
            or request_id in self._aborted
            or self.scheduler.holds(request_id)
        )
        if known:
            logger.info("dropping a late handoff for %s", request_id)
        return known

    def _accept_part(self, part: HandoffPart) -> None:
        request_id = part.request_id
        pending = self._pending.get(request_id)
        if pending is None:
            if part.part_index != 0 or self._known(request_id):
                return  # an earlier part was not taken: the handoff will say what to do
            pages = self.scheduler.reserve(part.num_prompt_tokens)
            if pages is None:
                logger.info("no room for %s's %d-token prompt yet; waiting for its handoff",
                            request_id, part.num_prompt_tokens)  # fmt: skip
                return
            pending = PendingHandoff(request_id, pages)
            self._pending[request_id] = pending
        elif pending.handoff is not None or pending.error is not None:
            return  # a part after the handoff, or after one went wrong: nothing to gain
        pending.updated = time.monotonic()
        try:
            transfer = part.transfer
            end = part.first_page + len(transfer.block_ids)
            if part.part_index != pending.num_parts or part.first_page != pending.next_page:
                raise TransferError(
                    f"part {part.part_index} from page {part.first_page} arrived after "
                    f"{pending.num_parts} parts and {pending.next_page} pages"
                )
            if not transfer.block_ids or end > len(pending.dst_block_ids):
                raise TransferError(f"part ends at page {end} of {len(pending.dst_block_ids)}")
        except TransferError as exc:
            pending.error = f"bad handoff part: {exc}"
            return
        dst = pending.dst_block_ids[part.first_page : end]
        if self._start_fetch(pending, part.transfer_id, transfer, dst):
            pending.num_parts += 1
            pending.next_page = end

    def _accept_handoff(self, handoff: Handoff) -> None:
        request_id = handoff.request_id
        pending = self._pending.get(request_id)
        if pending is not None and pending.handoff is not None:
            logger.info("dropping a second handoff for %s", request_id)
            return
        if pending is None and self._known(request_id):
            return
        params = self.checked_params(request_id, handoff.params)
        if params is None:
            if pending is not None:
                self._discard(pending)
            return
        seq = Sequence.from_prompt(request_id, handoff.prompt_token_ids, params)
        seq.token_ids.append(handoff.first_token.token_id)
        seq.num_cached_tokens = handoff.num_cached_tokens
        num_pages = ceil_div(seq.num_prompt_tokens, self.block_manager.block_size)
        if handoff.first_page == 0 and pending is not None:
            self._discard(pending)  # every page is offered again: the parts are not needed
            pending = None
        if handoff.first_page > 0:
            problem = self._parts_problem(pending, handoff, num_pages)
            if problem is not None:
                logger.warning("%s's early pages are not all here (%s); prefilling it here",
                               request_id, problem)  # fmt: skip
                if pending is not None:
                    self._discard(pending)
                self._prefill_locally(seq)
                return
        try:
            transfer = handoff.transfer
            if len(transfer.block_ids) != num_pages - handoff.first_page:
                raise TransferError(
                    f"{len(transfer.block_ids)} pages offered after page {handoff.first_page} "
                    f"for a prompt that needs {num_pages}"
                )
        except TransferError as exc:
            if pending is not None:
                self._discard(pending)
            self.fail(request_id, f"bad handoff: {exc}", retryable=True)
            return
        if pending is None:
            pages = self.scheduler.reserve(seq.num_prompt_tokens)
            if pages is None:
                logger.warning("no room for %s's %d pages; prefilling it here", request_id,
                               num_pages)  # fmt: skip
                self._prefill_locally(seq)
                return
            pending = PendingHandoff(request_id, pages)
            self._pending[request_id] = pending
        pending.handoff, pending.seq = handoff, seq
        self._start_fetch(
            pending, request_id, transfer, pending.dst_block_ids[handoff.first_page :]
        )
        self._settle(pending)

    @staticmethod
    def _parts_problem(
        pending: PendingHandoff | None, handoff: Handoff, num_pages: int
    ) -> str | None:
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
        if len(pending.dst_block_ids) != num_pages:
            return f"{len(pending.dst_block_ids)} pages reserved for a prompt of {num_pages}"
        return None

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
        pending.updated = time.monotonic()
        if not result.ok:
            pending.error = pending.error or f"fetching pages failed ({result.error})"
        elif not pending.aborted:
            KV_PAGES_RECEIVED.inc(result.num_pages)
        self._settle(pending)

    def _settle(self, pending: PendingHandoff) -> None:
        """Once no fetch of ``pending`` is running: free its pages if it was dropped, admit it
        if its handoff came and every page arrived, prefill it here if one could not."""
        if pending.fetches:
            return
        if pending.aborted:
            self.scheduler.drop_reservation(pending.dst_block_ids)
            return
        if pending.handoff is None or pending.seq is None:
            return  # the parts are in; the handoff has not come yet
        del self._pending[pending.request_id]
        seq = pending.seq
        if pending.error is not None:
            logger.warning("%s: %s; prefilling it here", seq.request_id, pending.error)
            self.scheduler.drop_reservation(pending.dst_block_ids)
            self._prefill_locally(seq)
            return
        if pending.handoff.prefill_done_at is not None:
            seq.handoff_wait_s = max(0.0, time.time() - pending.handoff.prefill_done_at)
            KV_HANDOFF_SECONDS.observe(seq.handoff_wait_s)
        try:
            self.scheduler.admit_prefilled(seq, pending.dst_block_ids)
        except ValueError as exc:
            self.fail(seq.request_id, str(exc), retryable=False)

    def _discard(self, pending: PendingHandoff) -> None:
        """Stop waiting for ``pending``'s pages; they are freed once no fetch writes them."""
        self._pending.pop(pending.request_id, None)
        pending.aborted = True
        for transfer_id in pending.fetches:
            self.receiver.abort(transfer_id)  # reported through receiver.poll()
        self._settle(pending)

    def _withdraw_parts(self, request_id: str) -> None:
        """The prefill worker will not hand ``request_id`` off after all (it was aborted there,
        or its first token ended it): drop the parts held for it. Only parts: a request the
        router has since re-dispatched here is the router's to stop."""
        pending = self._pending.get(request_id)
        if pending is not None and pending.handoff is None:
            self._discard(pending)

    def _expire_parts(self) -> None:
        now = time.monotonic()
        if now < self._next_parts_check:
            return
        self._next_parts_check = now + 1.0
        for pending in list(self._pending.values()):
            if pending.handoff is None and now - pending.updated > _PARTS_TIMEOUT_S:
                logger.warning("no handoff for %s's parts in %.0fs; dropping them",
                               pending.request_id, _PARTS_TIMEOUT_S)  # fmt: skip
                self._discard(pending)

    def _prefill_locally(self, seq: Sequence) -> None:
        KV_TRANSFER_FALLBACKS.inc()
        seq.block_ids = []
        seq.num_computed_tokens = 0
        self.admit(seq)

    def _drop_request(self, request_id: str) -> bool:
        """Stop serving a request wherever it is here; whether there was one."""
        pending = self._pending.get(request_id)
        if pending is not None:
            self._discard(pending)
            return True
        return self.scheduler.abort(request_id) is not None

    @staticmethod
    def _drop(reason: str) -> None:
        BAD_MESSAGES.labels(socket="handoff").inc()
        logger.warning("dropped a bad handoff frame: %s", reason)

    def close(self) -> None:
        self.handoffs.close(linger=0)
        self.receiver.close()
        super().close()


def build_parser() -> argparse.ArgumentParser:
    return worker_parser("pdserve decode", "Run a decode worker.", _add_decode_args)


def main(argv: list[str] | None = None) -> int:
    return run_worker(DecodeWorker, build_parser(), argv)


def _add_decode_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for a handoff's pages before prefilling the prompt here",
    )
