"""The NIXL tests skip, saying why, where the NIXL wheels are not installed (``make install``
brings them): a missing optional backend is not a failure of pdserve."""

from __future__ import annotations

import pytest


def _nixl_installed() -> bool:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


NIXL_INSTALLED = _nixl_installed()
needs_nixl = pytest.mark.skipif(
    not NIXL_INSTALLED,
    reason="NIXL is not installed (make install brings nixl-cu12 and the nixl wheel)",
)


def backend_params(*names: str) -> list:
    """``names`` (``nixl``, ``zmq:bf16``, ...) as parametrize values; NIXL's skip without it."""
    return [pytest.param(n, marks=needs_nixl) if n.startswith("nixl") else n for n in names]
