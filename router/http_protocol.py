"""uvicorn's HTTP protocol with a deadline on reading each request, and a cap on its headers.

uvicorn closes idle keep-alive connections, but a client that sends its request a byte at a
time (slowloris) keeps the connection, and what it holds, for as long as it likes. Here every
request must arrive whole (headers and body) within ``read_timeout`` seconds of the connection
opening or of the previous response; otherwise the connection is closed. Headers beyond
``MAX_HEADER_BYTES`` get a 400. Reading a request is the client's business; answering it (a long
stream) is not bounded by this.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10


class HeadersTooLarge(Exception):
    """Raised inside the parser's callback: uvicorn answers it with a 400 and closes."""


def with_read_deadline(read_timeout: float) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (``http=``) for a ``read_timeout`` in seconds."""
    if read_timeout <= 0:
        raise ValueError(f"the request read timeout must be > 0, got {read_timeout}")

    class ReadDeadlineProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            if self._deadline is None:  # a pipelined request: its own deadline starts now
                self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request has as long as the first

        def _count(self, nbytes: int) -> None:
            self._header_bytes += nbytes
            if self._header_bytes > MAX_HEADER_BYTES:
                raise HeadersTooLarge(f"request headers exceed {MAX_HEADER_BYTES} bytes")

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                logger.info(
                    "closed a connection from %s: no whole request within %.0f s",
                    self.client,
                    read_timeout,
                )
                self.transport.close()

    return ReadDeadlineProtocol
