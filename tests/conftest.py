"""Shared test set-up."""

from __future__ import annotations

import os

import torch

# Triton picks interpreter or compiler when a kernel is decorated, so this must be set before any
# kernel module is imported: on a machine without CUDA the kernels run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.manual_seed(0)
