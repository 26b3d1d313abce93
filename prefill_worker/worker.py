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

A decode worker prefilling a prompt itself may fetch the prompt's leading pages from here by
their hashes (ZMQ): the sender lends them from the pool or the KV tiers where they are
(``prefix_loans.py``), between steps, without running one.

This module holds the sockets and the dispatch of messages; ``shipments.py`` keeps the books of
what was shipped where, under which lease (``Shipments``).
"""

from __future__ import annotations

import argparse
import logging
import time

import zmq

from common import cluster_auth
from common.engine.batch import ScheduledSequence, SequenceOutput
from common.engine.scheduler import PrefillScheduler
from common.engine.sequence import Sequence
from common.messages import Message, encode
from common.metrics import REQUESTS
from common.protocol import AbortRequest, PrefillRequest, RegisterWorker
from common.service.worker_base import WorkerHost, WorkerService, worker_parser
from kvtransfer.tp_group import group_sender
from prefill_worker.prefix_loans import PrefixLoans
from prefill_worker.shipments import Shipments

logger = logging.getLogger(__name__)


class PrefillWorker(WorkerService):
    """pdserve prefill worker"""

    role = "prefill"

    def __init__(self, args: argparse.Namespace, host: WorkerHost | None = None) -> None:
        super().__init__(args, host)
        # At tensor-parallel size > 1 every rank sends its own KV heads (kvtransfer/tp_group.py).
        self.sender = group_sender(
            args.kv_transfer,
            self.engine.pool,
            self.worker_id,
            args.host,
            self.engine.followers,
            cluster_auth.load_secret(args.cluster_secret_file),
        )
        if self.sender.serves_prefixes():
            # A decode worker prefilling a prompt itself may fetch its leading pages from here,
            # straight from the pool or the tiers below it (prefix_loans.py).
            self.sender.lend_prefixes(
                PrefixLoans(self.engine.pool, self.page_manager, self.page_manager.tiers),
                args.kv_lease_seconds,
            )
        self.ship_chunks = args.ship_chunks
        scheduler = self.engine.scheduler
        assert isinstance(scheduler, PrefillScheduler)  # what LLMEngine(role="prefill") builds
        self.shipments = Shipments(
            self.sender,
            self.page_manager,
            release=scheduler.release,
            push=self._push_to,
            fail=self.fail,
            lease_seconds=args.kv_lease_seconds,
        )
        self._push: dict[str, zmq.Socket] = {}  # handoff endpoint -> socket

    def registration(self) -> RegisterWorker:
        lends = self.sender.serves_prefixes()
        return self.base_registration(kv_endpoint=self.sender.endpoint if lends else None)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            params = self.checked_params(msg.request_id, msg.params)
            if params is None:
                return
            seq = Sequence.from_prompt(msg.request_id, msg.prompt_token_ids, params)
            if self.under_adapter(seq, msg.lora_name) and self.admit(seq):
                self.shipments.expect(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)
        else:
            logger.debug("prefill worker ignores %s", type(msg).__name__)

    def poll_io(self) -> None:
        self.shipments.poll()

    def forget(self, request_id: str) -> None:
        self.shipments.withdraw(request_id)

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
        self.send_deltas([(seq, 1) for seq in finished], first=True)
        for seq in finished:
            if seq.finish_reason is not None:
                REQUESTS.labels(outcome=seq.finish_reason.value).inc()
            self.shipments.on_first_token(seq, done_at)
        if self.ship_chunks:
            self.shipments.ship_parts([item.seq for item in batch])

    def io_in_flight(self) -> bool:
        return self.sender.lending()  # a prefix loan's disk reads: offer it once they are done

    def num_pending(self) -> int:
        return self.shipments.num_handed_off()

    def _push_to(self, endpoint: str, msg: Message) -> bool:
        """PUSH ``msg`` to the decode worker at ``endpoint``, without blocking; False if that
        worker is not taking handoffs (the router will see it go silent)."""
        try:
            self._push_socket(endpoint).send(encode(msg), zmq.NOBLOCK)
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
        self.shipments.withdraw(request_id)
        if self.scheduler.abort(request_id) is not None:
            REQUESTS.labels(outcome="abort").inc()
        else:
            self.shipments.abort_handoff(request_id)  # its pages come back through poll()

    def close_role(self) -> None:
        for sock in self._push.values():
            sock.close(linger=0)
        self.sender.close()


def build_parser() -> argparse.ArgumentParser:
    return worker_parser("pdserve prefill", "Run a prefill worker.")
