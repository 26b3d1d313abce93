"""Keeping Python's cycle collector off the objects a long-running process builds at start-up."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """Serve with every object alive at the start out of the cycle collector's reach.

    A service's imports (torch, transformers, a tokenizer) and its model leave some 500k
    long-lived objects. A full collection walks them all (0.3-0.5 s on a 2-core CPU box), and one
    comes whenever the objects that survived since the last have grown past a quarter of them: in
    a decode worker, which keeps a sample object per generated token, every few thousand steps,
    each time a stall for every sequence in the batch. Those objects live as long as the process,
    so they are frozen (``gc.freeze``) for the block; the collector then walks only what serving
    creates. At the block's end they are handed back, so the interpreter's last collection
    finalises them (native bindings such as Triton's report what was never freed)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
