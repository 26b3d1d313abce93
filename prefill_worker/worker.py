"""The prefill worker: chunked prefill with a prefix cache, then a handoff to a decode worker.

For each ``PrefillRequest`` it computes the prompt's KV under the token budget, samples the
first token and sends it to the router at once (that is the time to first token; it does not wait
for the transfer), then publishes the prompt's pages to its KV sender and PUSHes a ``Handoff``
to the decode worker the router chose. The pages stay allocated, under a lease, until the
decode worker confirms it holds a copy or the lease ends.
"""

from __future__ import annotations

import argparse
import logging
import time

import zmq

from common.engine.scheduler import ScheduledSequence
from common.engine.sequence import Sequence
from common.messages import Message, encode
from common.metrics import KV_PAGES_SENT, REQUESTS
from common.protocol import AbortRequest, Handoff, PrefillRequest, RegisterWorker
from common.service.worker_base import WorkerService, run_worker, sample_to_wire, worker_parser
from kvtransfer import create_sender

logger = logging.getLogger(__name__)


class PrefillWorker(WorkerService):
    """pdserve prefill worker"""

    role = "prefill"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.sender = create_sender(args.kv_transfer, self.engine.pool, self.worker_id, args.host)
        self.lease_seconds = args.kv_lease_seconds
        self._targets: dict[str, PrefillRequest] = {}  # request id -> where its handoff goes
        self._shipped: dict[str, Sequence] = {}  # request id -> sequence holding leased pages
        self._push: dict[str, zmq.Socket] = {}  # handoff endpoint -> socket

    def registration(self) -> RegisterWorker:
        return self.base_registration()

    def handle(self, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            params = self.parse_params(msg.request_id, msg.params)
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
        for request_id in self.sender.poll():
            seq = self._shipped.pop(request_id, None)
            if seq is not None:
                self.scheduler.release(seq)

    def extra_sockets(self) -> list:
        return list(self.sender.poll_sockets())

    def on_finished_step(self, batch: list[ScheduledSequence], finished: list[Sequence]) -> None:
        done_at = time.time()  # the step that ran these prompts' last chunks just ended
        for seq in finished:
            target = self._targets.pop(seq.request_id)
            self.send_delta(seq, first=True)
            if seq.finish_reason is not None:
                REQUESTS.labels(outcome=seq.finish_reason.value).inc()
                continue  # its first token ended it: nothing to hand off
            self._hand_off(seq, target, done_at)

    def num_pending(self) -> int:
        return len(self._shipped)

    def _hand_off(self, seq: Sequence, target: PrefillRequest, done_at: float) -> None:
        transfer = self.sender.publish(seq.request_id, list(seq.block_ids), self.lease_seconds)
        self._shipped[seq.request_id] = seq
        handoff = Handoff(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            params=target.params,
            first_token=sample_to_wire(seq.samples[0]),
            transfer=transfer.to_dict(),
            num_cached_tokens=seq.num_cached_tokens,
            prefill_done_at=done_at,
        )
        try:
            self._push_socket(target.handoff_endpoint).send(encode(handoff), zmq.NOBLOCK)
        except zmq.Again:
            # The decode worker is not taking handoffs; the router will see it go silent.
            self.sender.abort(seq.request_id)
            self.fail(
                seq.request_id,
                f"decode worker {target.decode_worker_id} unreachable",
                retryable=True,
            )
            return
        KV_PAGES_SENT.inc(len(seq.block_ids))
        REQUESTS.labels(outcome="handed_off").inc()

    def _push_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        return sock

    def _abort(self, request_id: str) -> None:
        self._targets.pop(request_id, None)
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
