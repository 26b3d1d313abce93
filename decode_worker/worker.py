"""The decode worker: continuous batching over handed-off and locally prefilled requests.

A ``Handoff`` from a prefill worker reserves pages for the prompt and starts a fetch; when the
pages arrive the request joins the running batch with its prompt already computed. If the
fetch fails (the prefill worker died, the lease ran out) the reserved pages are released and the
prompt is prefilled here instead, so no request is lost. A ``DecodeRequest`` (a short prompt the
router did not send to a prefill worker, or a migrated request) is prefilled here from the
start. Every sampled token streams to the router as a ``TokenDelta``.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq

from common.engine.scheduler import ScheduledSequence
from common.engine.sequence import Sequence
from common.messages import Message, ProtocolError, decode
from common.metrics import (
    BAD_MESSAGES,
    KV_HANDOFF_SECONDS,
    KV_PAGES_RECEIVED,
    KV_TRANSFER_FALLBACKS,
    REQUESTS,
)
from common.protocol import AbortRequest, DecodeRequest, Handoff, RegisterWorker
from common.service.worker_base import WorkerService, run_worker, worker_parser
from kvtransfer import TransferError, TransferParams, TransferResult, create_receiver

logger = logging.getLogger(__name__)

# Handoffs carry prompts; this bounds one frame well above any prompt a worker can hold.
_MAX_HANDOFF_BYTES = 64 << 20
# An abort can overtake its request's handoff (they travel on different sockets); aborted ids
# are remembered this long so a late handoff is dropped, not served.
_ABORT_MEMORY_S = 120.0


@dataclass(slots=True)
class PendingFetch:
    seq: Sequence  # prompt + first token, pages not yet in place
    dst_block_ids: list[int]
    prefill_done_at: float  # the prefill worker's wall clock at its last chunk; 0: unknown
    aborted: bool = False


class DecodeWorker(WorkerService):
    """pdserve decode worker"""

    role = "decode"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.receiver = create_receiver(args.kv_transfer, self.engine.pool, self.worker_id)
        self.fetch_timeout = args.kv_fetch_timeout
        self.handoffs = self.context.socket(zmq.PULL)
        self.handoffs.setsockopt(zmq.LINGER, 0)
        self.handoffs.setsockopt(zmq.MAXMSGSIZE, _MAX_HANDOFF_BYTES)
        port = self.handoffs.bind_to_random_port(f"tcp://{args.host}")
        self.handoff_endpoint = f"tcp://{args.host}:{port}"
        self._pending: dict[str, PendingFetch] = {}
        self._aborted: OrderedDict[str, float] = OrderedDict()  # request id -> time.monotonic()

    def registration(self) -> RegisterWorker:
        return self.base_registration(handoff_endpoint=self.handoff_endpoint)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, DecodeRequest):
            params = self.parse_params(msg.request_id, msg.params)
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
            if not isinstance(msg, Handoff):
                self._drop(f"unexpected {type(msg).__name__} on the handoff socket")
                continue
            self._accept_handoff(msg)
        for result in self.receiver.poll():
            self._on_fetched(result)

    def extra_sockets(self) -> list:
        return [self.handoffs, *self.receiver.poll_sockets()]

    def on_finished_step(self, batch: list[ScheduledSequence], finished: list[Sequence]) -> None:
        for item in batch:
            if item.samples:
                self.send_delta(item.seq)
        for seq in finished:
            REQUESTS.labels(outcome=seq.finish_reason.value).inc()

    def num_pending(self) -> int:
        return len(self._pending)

    # -- handoffs -------------------------------------------------------------------------------

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

    def _accept_handoff(self, handoff: Handoff) -> None:
        request_id = handoff.request_id
        if self._known(request_id):
            return
        params = self.parse_params(request_id, handoff.params)
        if params is None:
            return
        seq = Sequence.from_prompt(request_id, handoff.prompt_token_ids, params)
        seq.token_ids.append(handoff.first_token.token_id)
        seq.num_cached_tokens = handoff.num_cached_tokens
        num_pages = -(-seq.num_prompt_tokens // self.block_manager.block_size)
        try:
            transfer = TransferParams.from_dict(handoff.transfer)
            if len(transfer.block_ids) != num_pages:
                raise TransferError(
                    f"{len(transfer.block_ids)} pages offered for a prompt that needs {num_pages}"
                )
        except TransferError as exc:
            self.fail(request_id, f"bad handoff: {exc}", retryable=True)
            return
        if num_pages > self.block_manager.num_free_blocks:
            logger.warning("no room for %s's %d pages; prefilling it here", request_id, num_pages)
            self._prefill_locally(seq)
            return
        dst = self.block_manager.allocate(num_pages)
        try:
            self.receiver.start_fetch(request_id, transfer, dst, self.fetch_timeout)
        except TransferError as exc:
            self.block_manager.free(dst)
            self.fail(request_id, f"bad handoff: {exc}", retryable=True)
            return
        self._pending[request_id] = PendingFetch(seq, dst, handoff.prefill_done_at)

    def _on_fetched(self, result: TransferResult) -> None:
        pending = self._pending.pop(result.request_id, None)
        if pending is None:
            return
        seq = pending.seq
        if pending.aborted:
            self.block_manager.free(pending.dst_block_ids)
            return
        if not result.ok:
            logger.warning("fetching %s's pages failed (%s)", seq.request_id, result.error)
            self.block_manager.free(pending.dst_block_ids)
            self._prefill_locally(seq)
            return
        KV_PAGES_RECEIVED.inc(result.num_pages)
        if pending.prefill_done_at > 0:
            KV_HANDOFF_SECONDS.observe(max(0.0, time.time() - pending.prefill_done_at))
        seq.block_ids = pending.dst_block_ids
        seq.num_computed_tokens = seq.num_prompt_tokens
        if not self.admit(seq):
            self.scheduler.release(seq)

    def _prefill_locally(self, seq: Sequence) -> None:
        KV_TRANSFER_FALLBACKS.inc()
        seq.block_ids = []
        seq.num_computed_tokens = 0
        self.admit(seq)

    def _drop_request(self, request_id: str) -> bool:
        """Stop serving a request wherever it is here; whether there was one."""
        pending = self._pending.get(request_id)
        if pending is not None and not pending.aborted:
            pending.aborted = True
            self.receiver.abort(request_id)  # its pages are freed when the fetch reports
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
