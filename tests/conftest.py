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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
