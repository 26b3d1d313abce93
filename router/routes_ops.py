"""The routes around generation: the model and worker lists, /health, /version, /metrics, /load, and
/tokenize and /detokenize with the served model's tokenizer."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from common.protocol import ROLE_DECODE, ROLE_PREFILL
from common.version import pdserve_version
from router.edge import body_schema, off_the_loop_if_large
from router.errors import BadRequest
from router.openai_api import (
    DetokenizeBody,
    TokenizeBody,
    chat_messages,
    encode_conversation,
)
from router.state import RouterState

PDSERVE_VERSION = pdserve_version()


def add_routes(app: FastAPI, state: RouterState) -> None:
    config, codec, edge, registry = state.config, state.codec, state.edge, state.registry
    listed_names = list(dict.fromkeys([config.served_model_name, *config.model_aliases]))

    def model_card(model_id: str, root: str, parent: str | None = None) -> dict:
        card = {
            "id": model_id,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "root": root,
            "max_model_len": config.max_model_len,
            # None until a worker has registered and said.
            "deterministic_inference": registry.deterministic,
        }
        if parent is not None:
            card["parent"] = parent
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        edge.authorize(request)
        root = config.worker_model or config.served_model_name
        return {
            "object": "list",
            "data": [model_card(name, root) for name in listed_names]
            # vLLM's entries for adapters: the adapter's folder as root, the model as parent.
            + [
                model_card(adapter.name, adapter.path, config.served_model_name)
                for adapter in config.lora_adapters.values()
            ],
        }

    @app.get("/v1/workers")
    async def workers(request: Request) -> dict:
        edge.authorize(request)
        return {
            role: [w.describe() for w in registry.pool(role)]
            for role in (ROLE_PREFILL, ROLE_DECODE)
        }

    @app.get("/v1/traffic")
    async def traffic(request: Request, window_s: float = 60.0) -> dict:
        """Recent arrivals and finished sequences with their lengths and latencies (what the
        planner observes; ``router/traffic.py``)."""
        edge.authorize(request)
        try:
            return state.metrics.traffic.window(time.monotonic(), window_s)
        except ValueError as exc:
            raise BadRequest(str(exc), "window_s") from exc

    @app.get("/health")
    async def health() -> Response:
        decode = len(registry.pool(ROLE_DECODE))
        body = {
            "status": "ok" if decode else "no_decode_workers",
            "prefill_workers": len(registry.pool(ROLE_PREFILL)),
            "decode_workers": decode,
        }
        return JSONResponse(body, status_code=200 if decode else 503)

    @app.get("/version")
    async def version() -> dict:
        # vLLM answers {"version": ...} here; clients probe it to learn what they talk to.
        return {"version": PDSERVE_VERSION, "server": "pdserve"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(
            generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeBody))
    async def tokenize(request: Request) -> dict:
        edge.authorize(request)
        body = await edge.read_body(request, TokenizeBody)
        edge.check_model(body.model)
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
        edge.authorize(request)
        return {"server_load": state.load.requests}

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeBody))
    async def detokenize(request: Request) -> dict:
        edge.authorize(request)
        body = await edge.read_body(request, DetokenizeBody)
        edge.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < codec.vocab_size]
        if bad:
            raise BadRequest(
                f"token ids must be in [0, {codec.vocab_size}), got {bad[:5]}", "tokens"
            )
        return {"prompt": codec.decode(body.tokens)}
