"""The generation routes, /v1/completions and /v1/chat/completions: one ``Run``
(router/serving.py) per request, answered as one JSON body or as a stream of SSE chunks.

Whatever way a request ends (done, error, client gone), its run is closed, so nothing of it stays
on the workers, and /load stops counting it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from router.admission import Overloaded
from router.beam_serving import BeamSearchRun
from router.edge import DirectRoute, body_schema, id_header, off_the_loop_if_large
from router.errors import APIError
from router.openai_api import ChatBody, CompletionBody, to_generation
from router.policy import NoWorkerError
from router.serving import Run
from router.state import RouterState, ServerLoad

logger = logging.getLogger(__name__)


def add_routes(app: FastAPI, state: RouterState) -> None:
    async def completions(request: Request) -> Response:
        return await generate(state, request, CompletionBody, "cmpl", "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await generate(state, request, ChatBody, "chatcmpl", "/v1/chat/completions")

    for path, endpoint, body_model in (
        ("/v1/completions", completions, CompletionBody),
        ("/v1/chat/completions", chat_completions, ChatBody),
    ):
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            openapi_extra=body_schema(body_model),
            route_class_override=DirectRoute,
        )


async def generate(
    state: RouterState, request: Request, body_model: type[BaseModel], kind: str, path: str
) -> Response:
    # /load counts a request from here until its response (or stream) has ended.
    state.load.requests += 1
    handed_to_stream = False
    try:
        response = await _generate_counted(state, request, body_model, kind, path)
        handed_to_stream = isinstance(response, StreamingResponse)
        return response
    finally:
        if not handed_to_stream:
            state.load.requests -= 1


async def _generate_counted(
    state: RouterState, request: Request, body_model: type[BaseModel], kind: str, path: str
) -> Response:
    arrived = time.monotonic()
    config, dispatcher, edge = state.config, state.dispatcher, state.edge
    rid = edge.request_id(request, kind)
    edge.authorize(request)
    body = await edge.read_body(request, body_model)
    adapter = edge.check_model(body.model)
    gen_request = await off_the_loop_if_large(
        request, to_generation, body, state.codec, config.max_model_len,
        request.headers.get("x-session-id"), config.default_max_tokens,
        max_request_tokens=config.max_request_tokens, parsing=config.parsing,
    )  # fmt: skip
    if adapter is not None:
        gen_request.lora_name, gen_request.cache_namespace = adapter.name, adapter.cache_namespace
    spec = gen_request.params.structured
    if spec is not None:
        if state.grammar_check is not None and gen_request.structured_field is not None:
            await state.grammar_check.check(spec, gen_request.structured_field)
        state.metrics.structured_count(spec.kind).inc()
    sequences = len(gen_request.prompts) * gen_request.n
    if sequences > config.max_inflight:
        raise APIError(
            400,
            f"this request asks for {sequences} sequences (n x prompts), more than the router "
            f"ever holds in flight ({config.max_inflight}, --max-inflight); lower n or send "
            "fewer prompts",
            param="n",
            code="invalid_request",
        )
    if len(dispatcher.generations) + sequences > config.max_inflight:
        state.metrics.refusals.labels("inflight").inc()
        raise APIError(
            429,
            f"the router has {len(dispatcher.generations)} sequences in flight "
            f"(limit {config.max_inflight}); retry later",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    # Answers name the adapter as their model, as vLLM's do.
    model_name = adapter.name if adapter is not None else config.served_model_name
    args = (gen_request, rid, model_name, dispatcher, state.token_text,
            state.metrics, arrived)  # fmt: skip
    if gen_request.use_beam_search:
        run: Run = BeamSearchRun(*args, eos_token_ids=frozenset(state.codec.eos_token_ids))
    else:
        run = Run(*args)
    try:
        run.submit()
    except NoWorkerError as exc:
        run.close("no_worker")
        raise APIError(503, f"no worker can serve the request: {exc}", code="no_worker") from None
    except Overloaded as exc:
        run.close("overloaded")
        raise APIError(
            429,
            str(exc),
            code="overloaded",
            headers={"Retry-After": str(exc.retry_after_s)},
        ) from None
    except Exception:
        # Whatever went wrong, nothing of this request may stay in flight; and the answer
        # is an error response, not a dropped connection.
        run.close("error")
        logger.exception("dispatching %s failed", rid)
        raise APIError(500, "internal server error", code="internal_error") from None
    headers = id_header(request)
    if gen_request.stream:
        state.metrics.request_count(path, "200").inc()
        return StreamingResponse(
            _stream(run, request, state.load), media_type="text/event-stream", headers=headers
        )
    gone = _watch_disconnect(run, request)
    try:
        result = await run.body()
    finally:
        gone.cancel()
        run.close("done")
    if gone.done() and not gone.cancelled():
        return Response(status_code=499)
    state.metrics.request_count(path, "200").inc()
    return JSONResponse(result, headers=headers)


async def _stream(run: Run, request: Request, load: ServerLoad) -> AsyncIterator[bytes]:
    gone = _watch_disconnect(run, request)
    cause = "client_disconnected"  # unless the loop below runs to its end
    try:
        async for chunk in run.sse():
            yield chunk
        cause = "done"
    except APIError as exc:
        # Headers are gone already: the error travels as a final SSE event, as OpenAI does.
        cause = "error"
        yield b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        gone.cancel()
        run.close(cause)
        load.requests -= 1


def _watch_disconnect(run: Run, request: Request) -> asyncio.Future:
    """Abort the run on the workers the moment the client goes, even while no token is due."""
    gone = asyncio.ensure_future(_disconnected(request))

    def on_gone(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            run.close("client_disconnected")
            run.interrupt()

    gone.add_done_callback(on_gone)
    return gone


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
