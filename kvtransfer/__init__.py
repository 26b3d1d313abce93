"""Moving KV pages from prefill workers to decode workers (see kvtransfer/base.py)."""

from kvtransfer.base import (
    KVReceiver,
    KVSender,
    OfferedPage,
    PrefixLender,
    PrefixLoan,
    TransferError,
    TransferParams,
    TransferResult,
)
from kvtransfer.registry import available_backends, create_receiver, create_sender

__all__ = [
    "KVReceiver",
    "KVSender",
    "OfferedPage",
    "PrefixLender",
    "PrefixLoan",
    "TransferError",
    "TransferParams",
    "TransferResult",
    "available_backends",
    "create_receiver",
    "create_sender",
]
