"""Hand memory freed after a large request back to the system.

A megabyte prompt is tokenized in a worker thread, and the tokenizer's many small allocations
land in that thread's glibc arena. Freed, they stay in the arena: glibc returns only the free top
of a heap, and fragmented arenas rarely have one. A router that refused a few dozen
multi-megabyte prompts (too long for the context, out-of-vocabulary ids, bad schema) so held
hundreds of megabytes it no longer used. ``malloc_trim(0)`` returns every arena's free pages;
``ReleaseFreedMemory`` calls it, in a thread, once a request with a large body has been answered
(and its body, token lists and exception are gone). Where the C library has no ``malloc_trim``
(musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> bool:
    """Return the C heap's free pages to the system; False where that cannot be done."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class ReleaseFreedMemory:
    """ASGI middleware: after an HTTP request whose body was at least ``min_body_bytes`` has been
    answered, ``release_freed_memory`` runs in a thread (the loop goes on serving). Requests that
    end while a release runs are covered by one more release after it, not one each."""

    def __init__(self, app: ASGIApp, min_body_bytes: int):
        self.app = app
        self.min_body_bytes = min_body_bytes
        self._running = False
        self._again = False
        self.releases = 0  # releases done (for tests and logs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if received >= self.min_body_bytes or _declared_length(scope) >= self.min_body_bytes:
                await self._release()

    async def _release(self) -> None:
        if self._running:
            self._again = True
            return
        self._running = True
        try:
            while True:
                self._again = False
                await asyncio.to_thread(release_freed_memory)
                self.releases += 1
                if not self._again:
                    return
        finally:
            self._running = False


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length (a body refused unread still counts), else 0."""
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
