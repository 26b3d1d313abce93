"""Shared test set-up."""

from __future__ import annotations

import os

import pytest
import torch

# Triton picks interpreter or compiler when a kernel is decorated, so this must be set before any
# kernel module is imported: on a machine without CUDA the kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.manual_seed(0)


def _patch_device_functions_once_per_launch() -> None:
    """Triton's interpreter patches its language module (``_patch_lang``: every builtin of
    ``tl``, ``tl.tensor``, ``tl.math``, found by ``inspect.getmembers``) at each kernel launch,
    and again at every call of a ``@triton.jit`` helper inside it, in every program. The helpers'
    patches find the language patched already and change nothing, yet cost ~3 ms each, and a
    store_kv launch pays two to four of them per token. So a helper's first call in a launch
    patches and its later ones skip; every launch still patches (and restores) the language as
    before. Where this Triton has no such internals, nothing changes."""
    try:
        from triton.runtime import interpreter

        patch_lang = interpreter._patch_lang
        launch = interpreter.GridExecutor.__call__
        empty_scope = interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return
    patched: set[object] = set()  # the functions patched in the launch under way

    def patch_once(fn):
        if fn in patched:
            return empty_scope()
        patched.add(fn)
        return patch_lang(fn)

    def launch_afresh(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_afresh


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_device_functions_once_per_launch()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
