"""The prefill worker: chunked prefill with a prefix cache, then a handoff to a decode worker.

For each ``PrefillRequest`` it computes the prompt's KV under the token budget, samples the
first token and sends it to the router at once (that is the time to first token; it does not wait
for the transfer), then publishes the prompt's pages to its KV sender and PUSHes a ``Handoff``
to the decode worker the router chose. The pages stay allocated, under a lease, until the
decode worker confirms it holds a copy or the lease ends.

A prompt that takes several chunks is shipped as it goes (``--ship-chunks``): after each chunk
its newly completed pages are published as a ``HandoffPart``, so when the last chunk ends only
the pages that chunk completed are left to move. Each part's lease holds its own reference on
its pages, so they stay intact while the decode worker reads them even if the sequence is
preempted or aborted meanwhile.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field

import zmq

from common.engine.scheduler import ScheduledSequence, SequenceOutput
from common.engine.sequence import Sequence
from common.messages import Message, encode
from common.metrics import KV_PAGES_SENT, REQUESTS
from common.protocol import AbortRequest, Handoff, HandoffPart, PrefillRequest, RegisterWorker
from common.service.worker_base import WorkerService, run_worker, sample_to_wire, worker_parser
from kvtransfer import create_sender

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ShippedParts:
    """The parts of one prompt shipped while it was still being prefilled."""

    num_pages: int = 0  # leading prompt pages shipped so far
    transfer_ids: list[str] = field(default_factory=list)  # one per part, in order
    broken: bool = False  # a part could not be sent: the handoff offers every page instead


class PrefillWorker(WorkerService):
    """pdserve prefill worker"""

    role = "prefill"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.sender = create_sender(args.kv_transfer, self.engine.pool, self.worker_id, args.host)
        self.lease_seconds = args.kv_lease_seconds
        self.ship_chunks = args.ship_chunks
        self._targets: dict[str, PrefillRequest] = {}  # request id -> where its handoff goes
        self._shipped: dict[str, Sequence] = {}  # request id -> sequence holding leased pages
        self._parts: dict[str, ShippedParts] = {}  # request id -> parts shipped so far
        self._part_pages: dict[str, list[int]] = {}  # part transfer id -> pages its lease holds
        self._push: dict[str, zmq.Socket] = {}  # handoff endpoint -> socket

    def registration(self) -> RegisterWorker:
        return self.base_registration()

    def handle(self, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            params = self.checked_params(msg.request_id, msg.params)
            if params is None:
                return
            seq = Sequence.from_prompt(msg.request_id, msg.prompt_token_ids, params)
            if self.admit(seq):
                self._targets[msg.request_id] = msg
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)
        else:
            logger.debug("prefill worker ignores %s", type(msg).__name__)

    def poll_io(self) -> None:
        for transfer_id in self.sender.poll():
            part_pages = self._part_pages.pop(transfer_id, None)
            if part_pages is not None:
                self.block_manager.free(part_pages)  # the lease's reference
                continue
            seq = self._shipped.pop(transfer_id, None)
            if seq is not None:
                self.scheduler.release(seq)

    def extra_sockets(self) -> list:
        return list(self.sender.poll_sockets())

    def serve_during_step(self):
        # A decode worker fetching the pages of a prompt finished in the last step is answered
        # now, not after this one (a prefill step on a CPU takes hundreds of milliseconds).
        return self.sender.serve_requests, list(self.sender.poll_sockets())

    def on_finished_step(
        self, batch: list[ScheduledSequence], outputs: list[SequenceOutput]
    ) -> None:
        finished = [out.seq for out in outputs if out.left_batch]
        done_at = time.time()  # the step that ran these prompts' last chunks just ended
        # First tokens reach the router before any handoff is sent: they are the TTFT.
        self.send_deltas([self.delta(seq, first=True) for seq in finished])
        for seq in finished:
            target = self._targets.pop(seq.request_id)
            parts = self._parts.pop(seq.request_id, None)
            if seq.finish_reason is not None:
                REQUESTS.labels(outcome=seq.finish_reason.value).inc()
                if parts is not None:
                    self._withdraw(seq.request_id, parts, target)
                continue  # its first token ended it: nothing to hand off
            self._hand_off(seq, target, done_at, parts)
        if self.ship_chunks:
            for item in batch:
                target = self._targets.get(item.seq.request_id)
                if target is not None:  # still prefilling
                    self._ship_part(item.seq, target)

    def num_pending(self) -> int:
        return len(self._shipped)

    def _ship_part(self, seq: Sequence, target: PrefillRequest) -> None:
        """Publish the prompt pages ``seq`` completed since its last part, if any."""
        parts = self._parts.setdefault(seq.request_id, ShippedParts())
        num_full = seq.num_computed_tokens // self.block_manager.block_size
        if parts.broken or num_full <= parts.num_pages:
            return
        pages = seq.block_ids[parts.num_pages : num_full]
        transfer_id = f"{seq.request_id}/part{len(parts.transfer_ids)}"
        try:
            transfer = self.sender.publish(transfer_id, pages, self.lease_seconds)
        except Exception as exc:  # e.g. a request id that collides with a part's id
            logger.warning("cannot ship part of %s early: %s", seq.request_id, exc)
            parts.broken = True
            return
        # The lease's own reference: the pages outlive a preemption or abort of the sequence
        # until the decode worker has them (or the lease ends).
        self.block_manager.acquire(pages)
        self._part_pages[transfer_id] = pages
        part = HandoffPart(
            request_id=seq.request_id,
            part_index=len(parts.transfer_ids),
            first_page=parts.num_pages,
            num_prompt_tokens=seq.num_prompt_tokens,
            transfer_id=transfer_id,
            transfer=transfer,
        )
        if not self._push_to(target, part):
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
            self._push_to(target, AbortRequest(request_id))

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
        pages = list(seq.block_ids[first_page:])
        transfer = self.sender.publish(seq.request_id, pages, self.lease_seconds)
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
        )
        if not self._push_to(target, handoff):
            # The decode worker is not taking handoffs; the router will see it go silent.
            self.sender.abort(seq.request_id)
            if parts is not None:
                self._withdraw(seq.request_id, parts, target)
            self.fail(
                seq.request_id,
                f"decode worker {target.decode_worker_id} unreachable",
                retryable=True,
            )
            return
        KV_PAGES_SENT.inc(len(pages))
        REQUESTS.labels(outcome="handed_off").inc()

    def _push_to(self, target: PrefillRequest, msg: Message) -> bool:
        """PUSH ``msg`` to the decode worker the router chose, without blocking; False if that
        worker is not taking handoffs (the router will see it go silent)."""
        try:
            self._push_socket(target.handoff_endpoint).send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _push_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            self.auth.client(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        return sock

    def _abort(self, request_id: str) -> None:
        target = self._targets.pop(request_id, None)
        parts = self._parts.pop(request_id, None)
        if parts is not None and target is not None:
            self._withdraw(request_id, parts, target)
        if self.scheduler.abort(request_id) is not None:
            REQUESTS.labels(outcome="abort").inc()
        elif request_id in self._shipped:
            self.sender.abort(request_id)  # its pages come back through sender.poll()

    def close(self) -> None:
        for sock in self._push.values():
            sock.close(linger=0)
        self.sender.close()
        super().close()


def build_parser() -> argparse.ArgumentParser:
    return worker_parser("pdserve prefill", "Run a prefill worker.", _add_prefill_args)


def main(argv: list[str] | None = None) -> int:
    return run_worker(PrefillWorker, build_parser(), argv)


def _add_prefill_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=30.0,
        help="how long shipped pages stay pinned waiting for the decode worker",
    )
    parser.add_argument(
        "--ship-chunks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ship a long prompt's pages after each chunk, while the next computes",
    )
