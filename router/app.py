"""The router's FastAPI app: OpenAI routes, worker listing, health and metrics.

Request bodies are read and parsed here (not by FastAPI's body injection) so that the size limit
(413), malformed JSON (400) and schema errors (400) all answer in OpenAI's error shape; the
published OpenAPI schema still describes each body.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.cluster_auth import ClusterAuth
from common.protocol import ROLE_DECODE, ROLE_PREFILL
from router.control import ControlServer
from router.dispatcher import Dispatcher
from router.errors import APIError, BadRequest
from router.metrics import RouterMetrics
from router.openai_api import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TextCodec,
    TokenizeBody,
    chat_messages,
    encode_conversation,
    to_generation,
)
from router.policy import NoWorkerError, RoutingConfig
from router.registry import WorkerRegistry
from router.request_metrics import ServiceLevel
from router.serving import Run, TokenText

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Bodies larger than this are parsed into prompts (tokenized) in a thread, off the event loop.
OFFLOAD_BODY_BYTES = 64 << 10
_REQUEST_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
_MAX_REQUEST_ID = 64


@dataclass(slots=True)
class RouterConfig:
    served_model_name: str  # the name responses report, and the first in /v1/models
    max_model_len: int
    # Other names requests may use: --served-model-name's others (listed in /v1/models), and
    # the model's path (accepted, not listed), as vLLM serves a model under the path it was given.
    model_aliases: tuple[str, ...] = ()
    model_path_names: tuple[str, ...] = ()
    # The model name workers register with (their model folder's name); None: the served name.
    worker_model: str | None = None
    control: str = "tcp://127.0.0.1:8001"
    api_key: str | None = None
    heartbeat_timeout: float = 3.0
    # Seconds a request may go without a token before it is sent again (a new attempt).
    request_stall_timeout: float = 120.0
    # The most tokens a chat request without max_tokens gets; None: the rest of the context.
    default_max_tokens: int | None = None
    max_retries: int = 3
    max_body_bytes: int = 4 << 20
    max_inflight: int = 4096  # sequences in flight; more -> 429
    # Workers must prove it on the control socket (common/cluster_auth); None: in the clear.
    cluster_secret: str | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    slo: ServiceLevel = field(default_factory=ServiceLevel)  # what counts as goodput


def create_app(config: RouterConfig, codec: TextCodec, eos_token_ids: frozenset[int]) -> FastAPI:
    metrics = RouterMetrics(config.slo)
    registry = WorkerRegistry(
        config.worker_model or config.served_model_name, config.heartbeat_timeout
    )
    listed_names = list(dict.fromkeys([config.served_model_name, *config.model_aliases]))
    accepted_names = {*listed_names, *config.model_path_names}
    auth = ClusterAuth(
        config.cluster_secret, lambda name: metrics.auth_failures.labels(socket=name).inc()
    )
    control = ControlServer(config.control, config.heartbeat_timeout, auth)
    dispatcher = Dispatcher(
        registry,
        config.routing,
        metrics,
        control.send,
        config.max_retries,
        heartbeat_interval=min(1.0, config.heartbeat_timeout / 3),
        stall_timeout=config.request_stall_timeout,
    )
    token_text = TokenText(codec.decode, eos_token_ids)
    load = ServerLoad()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        control.start(dispatcher)
        logger.info("control socket bound at %s", control.endpoint)
        yield
        await control.stop()

    app = FastAPI(title="pdserve router", version="0.1.0", lifespan=lifespan)
    app.state.config = config
    app.state.control = control
    app.state.dispatcher = dispatcher
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.load = load

    # -- the edge: errors, auth, ids, bodies --------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.request_count(request.url.path, str(exc.status)).inc()
        return exc.response(_id_header(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), config.api_key.encode()
        ):
            raise APIError(401, "Incorrect or missing API key", code="invalid_api_key")

    def request_id(request: Request, kind: str) -> str:
        given = request.headers.get("x-request-id")
        safe = _REQUEST_ID_UNSAFE.sub("", given or "")[:_MAX_REQUEST_ID]
        # An id to correlate logs, not a secret: 128 random bits without a system call.
        prefix = safe or f"{random.getrandbits(128):032x}"
        request.state.request_id = prefix
        # A client may reuse its id; the counter keeps the router's ids unique.
        return dispatcher.new_request_id(f"{kind}-{prefix}")

    async def off_the_loop_if_large(request: Request, work: Callable[..., T], *args, **kwargs) -> T:
        """``work(*args, **kwargs)``, in a thread when the request's body is large: encoding a
        megabyte prompt takes seconds, and /health and every stream must not wait for it."""
        if getattr(request.state, "body_bytes", 0) > OFFLOAD_BODY_BYTES:
            return await asyncio.to_thread(work, *args, **kwargs)
        return work(*args, **kwargs)

    async def read_body(request: Request, model: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise _too_large(config.max_body_bytes)
        chunks = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise _too_large(config.max_body_bytes)
            chunks.append(chunk)
        raw = b"".join(chunks)
        request.state.body_bytes = size
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(part) for part in first.get("loc", ())]
            if first.get("type") == "json_invalid":
                raise BadRequest(f"the body is not valid JSON: {first.get('msg')}") from None
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}"
            raise BadRequest(message, loc[0] if loc else None) from None

    def check_model(name: str | None) -> None:
        if name is not None and name not in accepted_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist. This router serves "
                f"`{config.served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    # -- generation ----------------------------------------------------------------------------

    async def generate(
        request: Request, body_model: type[BaseModel], kind: str, path: str
    ) -> Response:
        # /load counts a request from here until its response (or stream) has ended.
        load.requests += 1
        handed_to_stream = False
        try:
            response = await generate_counted(request, body_model, kind, path)
            handed_to_stream = isinstance(response, StreamingResponse)
            return response
        finally:
            if not handed_to_stream:
                load.requests -= 1

    async def generate_counted(
        request: Request, body_model: type[BaseModel], kind: str, path: str
    ) -> Response:
        arrived = time.monotonic()
        rid = request_id(request, kind)
        authorize(request)
        body = await read_body(request, body_model)
        check_model(body.model)
        gen_request = await off_the_loop_if_large(
            request, to_generation, body, codec, config.max_model_len,
            request.headers.get("x-session-id"), config.default_max_tokens,
        )  # fmt: skip
        sequences = len(gen_request.prompts) * gen_request.n
        if len(dispatcher.generations) + sequences > config.max_inflight:
            raise APIError(
                429,
                f"the router has {len(dispatcher.generations)} sequences in flight "
                f"(limit {config.max_inflight}); retry later",
                code="rate_limit_exceeded",
            )
        run = Run(
            gen_request, rid, config.served_model_name, dispatcher, token_text, metrics, arrived
        )
        try:
            run.submit()
        except NoWorkerError as exc:
            run.close("no_worker")
            raise APIError(
                503, f"no worker can serve the request: {exc}", code="no_worker"
            ) from None
        except Exception:
            # Whatever went wrong, nothing of this request may stay in flight; and the answer
            # is an error response, not a dropped connection.
            run.close("error")
            logger.exception("dispatching %s failed", rid)
            raise APIError(500, "internal server error", code="internal_error") from None
        headers = _id_header(request)
        if gen_request.stream:
            metrics.request_count(path, "200").inc()
            return StreamingResponse(
                _stream(run, request, load), media_type="text/event-stream", headers=headers
            )
        gone = _watch_disconnect(run, request)
        try:
            result = await run.body()
        finally:
            gone.cancel()
            run.close("done")
        if gone.done() and not gone.cancelled():
            return Response(status_code=499)
        metrics.request_count(path, "200").inc()
        return JSONResponse(result, headers=headers)

    async def completions(request: Request) -> Response:
        return await generate(request, CompletionBody, "cmpl", "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatBody, "chatcmpl", "/v1/chat/completions")

    for path, endpoint, body_model in (
        ("/v1/completions", completions, CompletionBody),
        ("/v1/chat/completions", chat_completions, ChatBody),
    ):
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            openapi_extra=_body_schema(body_model),
            route_class_override=_DirectRoute,
        )

    # -- the rest of the API -------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "root": config.worker_model or config.served_model_name,
                    "max_model_len": config.max_model_len,
                    # None until a worker has registered and said.
                    "deterministic_inference": registry.deterministic,
                }
                for name in listed_names
            ],
        }

    @app.get("/v1/workers")
    async def workers(request: Request) -> dict:
        authorize(request)
        return {
            role: [w.describe() for w in registry.pool(role)]
            for role in (ROLE_PREFILL, ROLE_DECODE)
        }

    @app.get("/health")
    async def health() -> Response:
        decode = len(registry.pool(ROLE_DECODE))
        body = {
            "status": "ok" if decode else "no_decode_workers",
            "prefill_workers": len(registry.pool(ROLE_PREFILL)),
            "decode_workers": decode,
        }
        return JSONResponse(body, status_code=200 if decode else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeBody))
    async def tokenize(request: Request) -> dict:
        authorize(request)
        body = await read_body(request, TokenizeBody)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            tokens = await off_the_loop_if_large(
                request, encode_conversation, body, codec, chat_messages(body)
            )
        else:
            tokens = await off_the_loop_if_large(
                request, codec.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": config.max_model_len,
            "token_strs": codec.token_strings(tokens) if body.return_token_strs else None,
        }

    @app.get("/load")
    async def server_load(request: Request) -> dict:
        authorize(request)
        return {"server_load": load.requests}

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeBody))
    async def detokenize(request: Request) -> dict:
        authorize(request)
        body = await read_body(request, DetokenizeBody)
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < codec.vocab_size]
        if bad:
            raise BadRequest(
                f"token ids must be in [0, {codec.vocab_size}), got {bad[:5]}", "tokens"
            )
        return {"prompt": codec.decode(body.tokens)}

    return app


class _DirectRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` and returns a ``Response`` itself.

    FastAPI's per-request parameter resolution (query, headers, body; none of which these
    endpoints declare) is skipped; the OpenAPI entry and the exception handlers stay as they are.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return self.endpoint


@dataclass(slots=True)
class ServerLoad:
    """Generation requests being answered (vLLM's ``/load``): a load balancer in front of
    several routers reads it."""

    requests: int = 0


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


def _id_header(request: Request) -> dict[str, str]:
    rid = getattr(request.state, "request_id", None)
    return {"X-Request-Id": rid} if rid else {}


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large"
    )


def _body_schema(model: type[BaseModel]) -> dict:
    """A request body in the OpenAPI document, its ``$defs`` inlined (the document has none)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.split("/")[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }
