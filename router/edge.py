"""The HTTP edge: what every route does at the door, and the errors it answers with.

Request bodies are read and parsed here (not by FastAPI's body injection) so that the size limit
(413), malformed JSON (400) and schema errors (400) all answer in OpenAI's error shape; the
published OpenAPI schema still describes each body (``body_schema`` on a ``DirectRoute``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import re
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.config import RouterAdapter, RouterConfig
from router.errors import APIError, BadRequest
from router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Bodies larger than this are parsed into prompts (tokenized) in a thread, off the event loop.
OFFLOAD_BODY_BYTES = 64 << 10
_REQUEST_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
_MAX_REQUEST_ID = 64
# A body over the limit is read to its end (and dropped) before the 413 goes out, up to this
# much: a server that answers and closes while the client still sends resets the connection,
# and a client that sends its whole body before reading (urllib, most scripts) then sees the
# reset, not the 413. Past this the connection is closed unread.
_DRAIN_MAX_BYTES = 64 << 20


def install_error_handlers(app: FastAPI, metrics: RouterMetrics) -> None:
    """Every error leaves ``app`` in OpenAI's shape; ``APIError``s are counted by path."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.request_count(request.url.path, str(exc.status)).inc()
        return exc.response(id_header(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()


class Edge:
    """The checks a route makes before its own work: the API key, the request's id, the body
    (size limit, JSON, schema) and the model name. Each raises ``APIError`` to refuse."""

    def __init__(self, config: RouterConfig, new_request_id: Callable[[str], str]):
        self._config = config
        self._accepted_names = frozenset(
            {config.served_model_name, *config.model_aliases, *config.model_path_names}
        )
        self._new_request_id = new_request_id  # unique per call, given a prefix

    @property
    def model_names(self) -> frozenset[str]:
        """The names of the base model requests may give."""
        return self._accepted_names

    def authorize(self, request: Request) -> None:
        api_key = self._config.api_key
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(401, "Incorrect or missing API key", code="invalid_api_key")

    def request_id(self, request: Request, kind: str) -> str:
        """The router's id for a generation request; the client's X-Request-Id (made safe for
        logs) or a random one is kept on ``request.state`` to answer with."""
        given = request.headers.get("x-request-id")
        safe = _REQUEST_ID_UNSAFE.sub("", given or "")[:_MAX_REQUEST_ID]
        # An id to correlate logs, not a secret: 128 random bits without a system call.
        prefix = safe or f"{random.getrandbits(128):032x}"
        request.state.request_id = prefix
        # A client may reuse its id; the counter keeps the router's ids unique.
        return self._new_request_id(f"{kind}-{prefix}")

    async def read_body(self, request: Request, model: type[BaseModel]) -> Any:
        """The body parsed as ``model``; its size is kept as ``request.state.body_bytes``.

        Only ``application/json`` is read, as vLLM does: a JSON body sent as text/plain, as a
        form or with no content type gets a 400, not an answer."""
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise BadRequest(
                "Unsupported Media Type: Only 'application/json' is allowed "
                f"(got {media_type or 'no content type'!r:.60})"
            )
        limit = self._config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if int(declared) <= _DRAIN_MAX_BYTES:
                await _drain(request, 0)
            raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                chunks.clear()
                await _drain(request, size)
                raise _too_large(limit)
            chunks.append(chunk)
        raw = b"".join(chunks)
        del chunks
        request.state.body_bytes = size
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            # Only plain values leave this block: the exception (and its traceback's frames,
            # which hold the body) must not outlive the request.
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
        first: Mapping[str, Any] = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ())]
        if first.get("type") == "json_invalid":
            raise BadRequest(f"the body is not valid JSON: {first.get('msg')}")
        raise BadRequest(_schema_message(first, loc), loc[0] if loc else None)

    def check_model(self, name: str | None) -> RouterAdapter | None:
        """Refuse a model name this router does not serve (vLLM's 404); returns the LoRA
        adapter the name is, None for the base model."""
        if name is not None and name in self._config.lora_adapters:
            return self._config.lora_adapters[name]
        if name is not None and name not in self._accepted_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist. This router serves "
                f"`{self._config.served_model_name}`.",
                param="model",
                code="model_not_found",
            )
        return None


async def off_the_loop_if_large(request: Request, work: Callable[..., T], *args, **kwargs) -> T:
    """``work(*args, **kwargs)``, in a thread when the request's body is large: encoding a
    megabyte prompt takes seconds, and /health and every stream must not wait for it."""
    if getattr(request.state, "body_bytes", 0) > OFFLOAD_BODY_BYTES:
        return await asyncio.to_thread(work, *args, **kwargs)
    return work(*args, **kwargs)


def id_header(request: Request) -> dict[str, str]:
    """The X-Request-Id header to answer with, once ``Edge.request_id`` has set one."""
    rid = getattr(request.state, "request_id", None)
    return {"X-Request-Id": rid} if rid else {}


def _schema_message(error: Mapping[str, Any], loc: list[str]) -> str:
    """A schema error as pydantic words it (``seed: Input should be less than or equal to N
    [type=less_than_equal]``): vLLM answers with pydantic's text, and clients match its type."""
    message = f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}"
    kind = error.get("type")
    return f"{message} [type={kind}]" if kind else message


async def _drain(request: Request, already: int) -> None:
    """Read what is left of an oversized body, keeping none of it (see ``_DRAIN_MAX_BYTES``)."""
    size = already
    async for chunk in request.stream():
        size += len(chunk)
        if size > _DRAIN_MAX_BYTES:
            return


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large"
    )


class DirectRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` and returns a ``Response`` itself.

    FastAPI's per-request parameter resolution (query, headers, body; none of which these
    endpoints declare) is skipped; the OpenAPI entry and the exception handlers stay as they are.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return self.endpoint


def body_schema(model: type[BaseModel]) -> dict:
    """A request body in the OpenAPI document (a route's ``openapi_extra``), its ``$defs``
    inlined (the document has none)."""
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
