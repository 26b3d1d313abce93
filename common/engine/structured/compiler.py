"""Compiling a sequence's spec into a grammar, off the step thread, each spec once.

``submit`` returns at once with a future; the scheduler keeps the sequence out of its queues
until the future is done (``common/engine/scheduler.py``), so a grammar that takes a while to
compile never holds up the other sequences' steps. xgrammar compiles first; where it raises,
or has not finished within ``timeout_s``, llguidance (which compiles lazily, at once) takes the
spec instead. A spec neither can compile fails its request (the router checks every spec with
llguidance before it sends it, so that is rare). Compiled grammars are kept by the spec's text,
the most recent ``CACHE_SIZE`` of them; both libraries are built from the model folder's
tokenizer on the first spec, so a worker that never sees one never pays for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.engine.structured.matcher import GrammarError, Matcher
from common.metrics import GRAMMAR_CACHE_HITS, GRAMMAR_COMPILE_SECONDS, GRAMMAR_COMPILES
from common.structured import StructuredSpec

logger = logging.getLogger(__name__)

# Grammars kept compiled: a service's schemas are usually a handful, reused by every request.
CACHE_SIZE = 256
# How long xgrammar may take before llguidance takes the spec instead.
DEFAULT_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar and the library that made it."""

    backend: Any  # XGrammarBackend or LLGuidanceBackend
    compiled: Any

    def matcher(self) -> Matcher:
        return self.backend.matcher(self.compiled)


class GrammarCompiler:
    def __init__(
        self,
        model_path: str | Path,
        vocab_size: int,
        stop_token_ids: list[int],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._model_path = str(model_path)
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._grammars: OrderedDict[tuple, Future[Grammar]] = OrderedDict()
        self._backends: tuple[Any, Any] | None = None  # built by the pool's thread, on first use

    def submit(self, spec: StructuredSpec) -> Future[Grammar]:
        """The spec's grammar, compiled or compiling; the future raises ``GrammarError`` where
        it cannot be compiled. Called from the step thread."""
        key = (spec.kind, spec.text, spec.any_whitespace)
        future = self._grammars.get(key)
        if future is not None:
            self._grammars.move_to_end(key)
            GRAMMAR_CACHE_HITS.inc()
            return future
        future = self._pool.submit(self._compile, spec)
        self._grammars[key] = future
        if len(self._grammars) > CACHE_SIZE:
            self._grammars.popitem(last=False)
        return future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredSpec) -> Grammar:
        xgrammar, llguidance = self._libraries()
        started = time.perf_counter()
        compiled, problem = _within(self._timeout_s, lambda: xgrammar.compile(spec))
        if compiled is not None:
            return self._compiled(xgrammar, compiled, started)
        logger.info("xgrammar did not compile a %s (%s); trying llguidance", spec.kind, problem)
        try:
            return self._compiled(llguidance, llguidance.compile(spec), started)
        except Exception as exc:  # the library's own error types
            GRAMMAR_COMPILES.labels(backend="none").inc()
            raise GrammarError(f"the {spec.kind} cannot be compiled: {exc}") from None

    def _compiled(self, backend: Any, compiled: Any, started: float) -> Grammar:
        GRAMMAR_COMPILES.labels(backend=backend.name).inc()
        GRAMMAR_COMPILE_SECONDS.labels(backend=backend.name).observe(time.perf_counter() - started)
        return Grammar(backend, compiled)

    def _libraries(self) -> tuple[Any, Any]:
        if self._backends is None:
            # Imported here: a worker that never sees a spec loads neither library.
            from transformers import AutoTokenizer

            from common.engine.structured.llguidance_backend import LLGuidanceBackend
            from common.engine.structured.xgrammar_backend import XGrammarBackend

            tokenizer = AutoTokenizer.from_pretrained(self._model_path)
            args = (tokenizer, self._vocab_size, self._stop_token_ids)
            self._backends = (XGrammarBackend(*args), LLGuidanceBackend(*args))
        return self._backends


def _within(timeout_s: float, compile_spec) -> tuple[Any, str | None]:
    """``compile_spec()``'s result, or (None, why) if it raised or ran past ``timeout_s`` (it is
    left to finish on a thread of its own, its result dropped)."""
    result: list[Any] = []
    errors: list[str] = []

    def run() -> None:
        try:
            result.append(compile_spec())
        except Exception as exc:  # the library's own error types
            errors.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, daemon=True, name="xgrammar-compile")
    thread.start()
    thread.join(timeout_s)
    if result:
        return result[0], None
    return None, errors[0] if errors else f"not done in {timeout_s:g} s"
