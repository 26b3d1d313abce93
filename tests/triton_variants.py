"""The compiled variants of Triton kernels a piece of work would need, found in the interpreter.

A compiled Triton kernel is built once per *specialisation* of its arguments: every constexpr's
value, each tensor's dtype and whether its address is a multiple of 16 bytes, and each integer
not marked ``do_not_specialize`` by whether it is 1 or a multiple of 16. A launch whose
specialisation is new compiles the kernel again, seconds on a GPU. The interpreter compiles
nothing, but the specialisation of each launch can still be worked out, with Triton's own
function for it: ``record_variants`` does that for every launch inside it. On a GPU,
``compiled_on_gpu`` counts what Triton has compiled.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Iterator

import pytest
import torch

interpreter = pytest.importorskip("triton.runtime.interpreter")
try:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except ImportError:  # a Triton without the function: the tests that need it skip
    native_specialize_impl = None

# A kernel's name -> the specialisations it was launched with (each with its launch options:
# num_warps and num_stages are part of what is compiled too).
Variants = dict[str, set[tuple]]


def specialisation(kernel, args: tuple, kwargs: dict) -> tuple:
    """What a compiled launch of ``kernel`` (an interpreted ``@triton.jit`` function) with
    these arguments would be compiled for."""
    signature = inspect.signature(kernel.fn)
    given = {name: value for name, value in kwargs.items() if name in signature.parameters}
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in signature.parameters))
    bound = signature.bind_partial(*args, **given).arguments
    unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, parameter in signature.parameters.items():
        if name not in bound:
            continue  # a constexpr left at its default
        value = bound[name]
        if "constexpr" in str(parameter.annotation):
            key.append((name, value))
        else:
            specialise = name not in unspecialised
            key.append((name, native_specialize_impl(BaseBackend, value, False, specialise, True)))
    return tuple(key), options


@contextlib.contextmanager
def record_variants() -> Iterator[Variants]:
    """Every Triton kernel launched inside, with the specialisations it was launched with."""
    if native_specialize_impl is None:
        pytest.skip("this Triton has no native_specialize_impl to work specialisations out with")
    if not hasattr(interpreter.InterpretedFunction, "run"):
        pytest.skip("Triton's interpreter has no InterpretedFunction.run to watch")
    seen: Variants = defaultdict(set)
    launch = interpreter.InterpretedFunction.run

    def recording_launch(self, *args, grid, warmup, **kwargs):
        seen[self.fn.__name__].add(specialisation(self, args, kwargs))
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_launch
    try:
        yield seen
    finally:
        interpreter.InterpretedFunction.run = launch


def new_variants(before: Variants, after: Variants) -> dict[str, list[str]]:
    """The specialisations in ``after`` that ``before`` lacks, kernel by kernel, each said as
    the arguments in which it differs from one that ``before`` has."""
    found: dict[str, list[str]] = {}
    for name, variants in after.items():
        known = before.get(name, set())
        for key, options in variants - known:
            if not known:
                found.setdefault(name, []).append("a kernel the warm-up never launched")
                continue
            near_key, near_options = next(iter(known))
            pairs = zip(key, near_key, strict=False)  # a constexpr left at its default: shorter
            differs = [f"{a[0]}: {a[1]} (was {b[1]})" for a, b in pairs if a != b]
            if options != near_options:
                differs.append(f"options {options} (was {near_options})")
            found.setdefault(name, []).append(", ".join(differs))
    return found


def compiled_on_gpu(kernel) -> int:
    """How many variants of ``kernel`` (compiled, not interpreted) Triton has compiled on the
    current GPU: its per-device cache's first member holds them by specialisation."""
    return len(kernel.device_caches[torch.cuda.current_device()][0])
