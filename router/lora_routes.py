"""LoRA adapters loaded and unloaded at runtime: vLLM's ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, served only with ``--allow-runtime-lora-updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and behind the API key like every other route.

A load reaches every registered worker of both pools (``LoadAdapter``) and is answered once each
has said it serves the adapter (``AdapterResult``); only then do requests naming it pass the
router. Where one worker refuses it (a bad file, a rank above its ``--max-lora-rank``), the
others unload it again and the answer is a 400 naming the worker and the problem. A worker that
registers later is sent every adapter loaded at runtime before any request.

An unload first stops new requests naming the adapter (they get the 404 of an unknown model),
waits for the requests in flight under it to finish (up to ``UNLOAD_WAIT_S``; past it the
adapter is served again and the answer is a 409 saying how many are still running), then asks
every worker to drop it. So no request under it is ever broken.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from common.lora_adapters import MAX_NAME_LENGTH, adapter_namespace, check_adapter_name
from common.messages import Message
from common.protocol import AdapterResult, LoadAdapter, UnloadAdapter
from router.config import RouterAdapter
from router.edge import body_schema
from router.errors import APIError, BadRequest
from router.state import RouterState

logger = logging.getLogger(__name__)

# How long a worker may take to answer a load or an unload.
WORKER_ANSWER_S = 60.0
# How long an unload waits for the requests in flight under its adapter.
UNLOAD_WAIT_S = 60.0
_POLL_S = 0.02


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH)


class AdapterUpdates:
    """The loads and unloads the router waits on, each answered by every worker it was sent to.
    Runs on the router's event loop, as the control socket does."""

    def __init__(self, send: Callable[[str, Message], None]) -> None:
        self._send = send
        self._ids = itertools.count()
        # operation id -> (workers yet to answer, answers so far, set once all are in)
        self._open: dict[str, tuple[set[str], dict[str, str | None], asyncio.Event]] = {}

    def new_operation_id(self) -> str:
        return f"lora-{next(self._ids)}"

    async def ask(
        self, workers: list[str], make: Callable[[str], Message], timeout: float
    ) -> dict[str, str | None]:
        """Send ``make(operation_id)`` to each of ``workers``; returns each one's answer (None:
        done; else why not, or that it did not answer within ``timeout``)."""
        operation_id = self.new_operation_id()
        awaited, done = set(workers), asyncio.Event()
        answers: dict[str, str | None] = {}
        if not awaited:
            return {}
        self._open[operation_id] = (awaited, answers, done)
        try:
            for worker_id in workers:
                self._send(worker_id, make(operation_id))
            try:
                await asyncio.wait_for(done.wait(), timeout)
            except asyncio.TimeoutError:
                for worker_id in awaited:
                    answers[worker_id] = f"worker {worker_id} did not answer within {timeout:g} s"
        finally:
            del self._open[operation_id]
        return answers

    def on_result(self, sender: str, msg: AdapterResult) -> None:
        waiting = self._open.get(msg.operation_id)
        if waiting is None:
            if msg.error is not None:
                logger.warning("worker %s: %s", sender, msg.error)
            return
        awaited, answers, done = waiting
        if sender in awaited:
            awaited.discard(sender)
            answers[sender] = msg.error
            if not awaited:
                done.set()


def add_routes(app: FastAPI, state: RouterState) -> None:
    config, edge, dispatcher, registry = state.config, state.edge, state.dispatcher, state.registry
    updates = AdapterUpdates(dispatcher.send)
    dispatcher.on_adapter_result = updates.on_result
    runtime: dict[str, RouterAdapter] = {}  # adapters loaded here, for workers that come later

    def load_on_new_worker(worker_id: str) -> None:
        for adapter in runtime.values():
            dispatcher.send(
                worker_id,
                LoadAdapter(updates.new_operation_id(), adapter.name, adapter.path),
            )

    dispatcher.on_registered = load_on_new_worker

    def check_allowed(request: Request) -> None:
        edge.authorize(request)
        if not config.enable_lora:
            raise BadRequest("this router serves no LoRA adapters (--enable-lora)")
        if not config.allow_runtime_lora_updating:
            raise APIError(
                404,
                "loading and unloading LoRA adapters at runtime is off "
                "(--allow-runtime-lora-updating)",
                code="not_found",
            )

    def workers() -> list[str]:
        return sorted(registry.workers)

    @app.post("/v1/load_lora_adapter", openapi_extra=body_schema(LoadLoraBody))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        check_allowed(request)
        body = await edge.read_body(request, LoadLoraBody)
        name, path = body.lora_name, body.lora_path
        if body.load_inplace:
            raise BadRequest("load_inplace is not served: unload the adapter, then load it")
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise BadRequest(str(exc), "lora_name") from None
        if name in config.lora_adapters or name in edge.model_names:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            namespace = await asyncio.to_thread(adapter_namespace, name, path)
        except ValueError as exc:
            raise BadRequest(str(exc), "lora_path") from None
        answers = await updates.ask(
            workers(), lambda op: LoadAdapter(op, name, path), WORKER_ANSWER_S
        )
        errors = {w: e for w, e in answers.items() if e is not None}
        if errors:
            loaded = [w for w, e in answers.items() if e is None]
            await updates.ask(loaded, lambda op: UnloadAdapter(op, name), WORKER_ANSWER_S)
            raise BadRequest("; ".join(errors[w] or "" for w in sorted(errors)), "lora_path")
        adapter = RouterAdapter(name, path, namespace)
        config.lora_adapters[name] = runtime[name] = adapter
        logger.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(answers))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=body_schema(UnloadLoraBody))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        check_allowed(request)
        body = await edge.read_body(request, UnloadLoraBody)
        name = body.lora_name
        adapter = config.lora_adapters.pop(name, None)
        if adapter is None:
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found"
            )
        deadline = time.monotonic() + UNLOAD_WAIT_S
        while (users := dispatcher.adapter_users(name)) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if users:
            config.lora_adapters[name] = adapter
            raise APIError(
                409,
                f"The lora adapter '{name}' is in use by {users} requests after "
                f"{UNLOAD_WAIT_S:g} s; try again",
                "lora_name",
                "adapter_in_use",
            )
        answers = await updates.ask(workers(), lambda op: UnloadAdapter(op, name), WORKER_ANSWER_S)
        runtime.pop(name, None)
        errors = [e for e in answers.values() if e is not None]
        if errors:
            logger.warning("unloading LoRA adapter %s: %s", name, "; ".join(errors))
        logger.info("LoRA adapter %s unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
