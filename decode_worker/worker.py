"""The decode worker: continuous batching over handed-off and locally prefilled requests.

A ``Handoff`` from a prefill worker reserves pages for the prompt and starts a fetch; when the
pages arrive the request joins the running batch with its prompt already computed. A long
prompt's leading pages may come earlier, in ``HandoffPart``s sent after each of its chunks: the
first part reserves the whole prompt's pages, each part's fetch starts at once, and the handoff
then brings only the rest. If a fetch fails (the prefill worker died, the lease ran out) the
reserved pages are released and the prompt is prefilled here instead, so no request is lost. A
``DecodeRequest`` (a short prompt the router did not send to a prefill worker, or a migrated
request) is prefilled here from the start, but for the leading pages a prefill worker holds,
which the request may name: those are fetched first (``prefix_fetches.py``). Every sampled
token streams to the router as a ``TokenDelta``.

This module holds the sockets and the dispatch of messages; ``handoffs.py`` keeps the books of
the pages on their way (``Handoffs``).
"""

from __future__ import annotations

import argparse
import logging

import zmq

from common import cluster_auth
from common.dropped_frames import MAX_FRAMES_PER_TURN, DroppedFrames
from common.engine.batch import ScheduledSequence, SequenceOutput
from common.engine.persistent_batch import DecodeOutputs
from common.engine.scheduler import DecodeScheduler
from common.engine.sequence import Sequence
from common.messages import Message, ProtocolError, decode
from common.metrics import BAD_MESSAGES, REQUESTS
from common.protocol import (
    AbortRequest,
    DecodeRequest,
    Handoff,
    HandoffPart,
    RegisterWorker,
)
from common.service.worker_base import WorkerHost, WorkerService, worker_parser
from decode_worker.handoffs import Handoffs
from decode_worker.prefix_fetches import PrefixFetches
from kvtransfer.tp_group import group_receiver

logger = logging.getLogger(__name__)

# Handoffs carry prompts; this bounds one frame well above any prompt a worker can hold.
_MAX_HANDOFF_BYTES = 64 << 20
# Steps at least this long have the step helper read handoffs as they come: it is then woken
# every step, tens of microseconds that only a step this long hides.
_HANDOFFS_DURING_STEPS_AFTER_S = 0.01


def size_problem(msg: Message, vocab_size: int, max_model_len: int) -> str | None:
    """What in a handoff or part lies outside this worker's own limits (a token id beyond the
    vocabulary, a prompt longer than the context, pages it could never hold), or None (also for
    any other message). Checked before anything is reserved or computed for it."""
    if isinstance(msg, HandoffPart):
        if not 1 <= msg.num_prompt_tokens < max_model_len:
            return f"a {msg.num_prompt_tokens}-token prompt (the context is {max_model_len})"
        if msg.part_index < 0 or msg.first_page < 0:
            return "a negative part index or page"
    elif isinstance(msg, Handoff):
        prompt = msg.prompt_token_ids
        if not 1 <= len(prompt) < max_model_len:
            return f"a {len(prompt)}-token prompt (the context is {max_model_len})"
        first = msg.first_token.token_id
        if not 0 <= first < vocab_size or not all(0 <= t < vocab_size for t in prompt):
            return f"token ids outside the vocabulary [0, {vocab_size})"
        if not 0 <= msg.num_cached_tokens <= len(prompt):
            return f"{msg.num_cached_tokens} cached tokens of a {len(prompt)}-token prompt"
        if msg.first_page < 0 or msg.num_parts < 0:
            return "a negative first page or part count"
    return None


class DecodeWorker(WorkerService):
    """pdserve decode worker"""

    role = "decode"
    output_beside_forward = True

    def __init__(self, args: argparse.Namespace, host: WorkerHost | None = None) -> None:
        super().__init__(args, host)
        # Takes pages from prefill workers of any tensor-parallel size; at size > 1 here, every
        # rank fetches its own KV heads (kvtransfer/tp_group.py).
        self.receiver = group_receiver(
            args.kv_transfer,
            self.engine.pool,
            self.worker_id,
            args.host,
            self.engine.followers,
            cluster_auth.load_secret(args.cluster_secret_file),
        )
        self._dropped_handoffs = DroppedFrames(
            "handoff socket", BAD_MESSAGES.labels(socket="handoff").inc, logger
        )
        self.handoff_socket = self.context.socket(zmq.PULL)
        self.auth.server(self.handoff_socket, "handoff")
        self.handoff_socket.setsockopt(zmq.LINGER, 0)
        self.handoff_socket.setsockopt(zmq.MAXMSGSIZE, _MAX_HANDOFF_BYTES)
        port = self.handoff_socket.bind_to_random_port(f"tcp://{args.host}")
        self.handoff_endpoint = f"tcp://{args.host}:{port}"
        scheduler = self.engine.scheduler
        assert isinstance(scheduler, DecodeScheduler)  # what LLMEngine(role="decode") builds
        self.prefix_fetches = PrefixFetches(
            self.receiver,
            scheduler,
            self.page_manager,
            admit=self.admit,
            fetch_timeout=args.kv_fetch_timeout,
            page_nbytes=self.engine.pool.layout.bytes_per_page,
        )
        self.handoffs = Handoffs(
            self.receiver,
            scheduler,
            checked_params=self.checked_params,
            admit=self.admit,
            fail=self.fail,
            fetch_timeout=args.kv_fetch_timeout,
            adapter_namespace=(
                self.engine.adapter_namespace if self.engine.lora is not None else None
            ),
            other_results=self.prefix_fetches.on_result,
        )

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
            self.handoffs.forget_abort(msg.request_id)
            self._drop_request(msg.request_id)
            seq = Sequence.from_prompt(msg.request_id, msg.prompt_token_ids, params)
            seq.token_ids.extend(msg.output_token_ids)  # a migrated request continues
            if self.under_adapter(seq, msg.lora_name):
                # The prompt's leading pages, where a prefill worker holds them, are fetched
                # first (a migrated request's are never named: its tokens so far are computed).
                source = msg.prefix if not msg.output_token_ids else None
                self.prefix_fetches.admit(seq, source)
        elif isinstance(msg, AbortRequest):
            self.handoffs.remember_abort(msg.request_id)
            if self._drop_request(msg.request_id):
                REQUESTS.labels(outcome="abort").inc()
        else:
            logger.debug("decode worker ignores %s", type(msg).__name__)

    def poll_io(self) -> None:
        self._read_handoffs()
        self.handoffs.poll()

    def _read_handoffs(self) -> None:
        """Take every frame waiting on the handoff socket: reserve its pages and start its fetch
        (``Handoffs``), or drop it with a logged reason."""
        vocab_size, max_model_len = self.engine.model_config.vocab_size, self.engine.max_model_len
        socket = self.handoff_socket
        for _ in range(MAX_FRAMES_PER_TURN):
            if not socket.poll(0):  # no zmq.Again raised every turn
                break
            try:
                frame = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = decode(frame, max_size=_MAX_HANDOFF_BYTES)
            except ProtocolError as exc:
                self._drop(str(exc))
                continue
            problem = size_problem(msg, vocab_size, max_model_len)
            if problem is not None:
                name = getattr(msg, "request_id", "?")
                self._drop(f"{type(msg).__name__} for {name!r}: {problem}")
            elif isinstance(msg, Handoff):
                self.handoffs.accept_handoff(msg)
            elif isinstance(msg, HandoffPart):
                self.handoffs.accept_part(msg)
            elif isinstance(msg, AbortRequest):
                self.handoffs.withdraw_parts(msg.request_id)
            else:
                self._drop(f"unexpected {type(msg).__name__} on the handoff socket")

    def serve_during_step(self):
        # A prompt's pages land while the forward runs, not between two steps, where copying
        # them would hold up every decoding sequence's next token; after long steps, handoffs
        # are read then too. What the fetches that ended mean for the batch is still decided
        # here, between steps (poll_io).
        return self._serve_during_step, self._sockets_during_step

    def steps_are_short(self) -> bool:
        # A decode step on a GPU is a millisecond or a few. (A prefill worker's steps are long:
        # its helper may as well send the first tokens and heartbeats.)
        return self.engine.device.type == "cuda"

    def reads_handoffs_during_step(self) -> bool:
        """Whether the step helper takes handoffs too. A handoff read only between steps waits
        for the rest of the step it came in, and its pages then for the whole next step: its
        request's second token comes two steps after its first. Read as it comes, its pages are
        in by the end of the step it came in. Only after a long step (a CPU's), since the
        helper is then woken every step; never where the loop itself sends during a step
        (``StepIO.pulse_inline``), since a handoff refused tells the router so, over the same
        link; and never where a fetch also commands tensor-parallel ranks, over the pipes the
        step itself uses."""
        return (
            self.last_step_seconds >= _HANDOFFS_DURING_STEPS_AFTER_S
            and not self._step_io.pulse_inline
            and self.engine.followers is None
        )

    def _sockets_during_step(self) -> list:
        sockets = self.receiver.transfer_sockets()
        if self.reads_handoffs_during_step():
            sockets = [self.handoff_socket, *sockets]
        return sockets

    def _serve_during_step(self) -> None:
        self.receiver.serve_transfers()
        if self.reads_handoffs_during_step():
            self._read_handoffs()  # fetches begin now; admitted between steps (poll_io)

    def extra_sockets(self) -> list:
        return [self.handoff_socket, *self.receiver.poll_sockets()]

    def on_finished_step(
        self, batch: list[ScheduledSequence], outputs: list[SequenceOutput]
    ) -> None:
        if isinstance(outputs, DecodeOutputs):  # a plain decode step: its token columns
            self.send_token_columns(outputs)
            for row in outputs.left:
                reason = outputs[row].seq.finish_reason
                assert reason is not None  # a decode leaves its batch only finished
                REQUESTS.labels(outcome=reason.value).inc()
            return
        self.send_deltas([(out.seq, len(out.new_samples)) for out in outputs])
        for out in outputs:
            reason = out.seq.finish_reason
            if out.left_batch and reason is not None:  # a decode leaves its batch only finished
                REQUESTS.labels(outcome=reason.value).inc()

    def num_pending(self) -> int:
        return self.handoffs.num_pending() + self.prefix_fetches.num_pending()

    def pending_progress(self) -> dict[str, int]:
        return {**self.handoffs.progress(), **self.prefix_fetches.progress()}

    def io_in_flight(self) -> bool:
        return self.receiver.progressing_silently()

    def _drop_request(self, request_id: str) -> bool:
        """Stop serving a request wherever it is here; whether there was one."""
        return (
            self.handoffs.discard(request_id)
            or self.prefix_fetches.discard(request_id)
            or self.scheduler.abort(request_id) is not None
        )

    def _drop(self, reason: str) -> None:
        self._dropped_handoffs.drop(reason)

    def close_role(self) -> None:
        self.handoff_socket.close(linger=0)
        self.receiver.close()


def build_parser() -> argparse.ArgumentParser:
    return worker_parser("pdserve decode", "Run a decode worker.")
