"""The `pdserve` command: a thin dispatcher that hands each subcommand to its package."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    print("usage: pdserve {generate,prefill,decode,router,up,convert} ...")
    return 2
