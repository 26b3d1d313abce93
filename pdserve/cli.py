"""The `pdserve` command: a thin dispatcher that hands each subcommand to its package's main()."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module whose main(argv) runs it, one-line help). Imported only when chosen, so
# `pdserve router` never loads torch's model code and `pdserve --help` is instant.
SUBCOMMANDS = {
    "generate": ("common.engine.generate", "generate a completion in one process"),
    "convert": ("common.model.default_model", "convert the bundled default model"),
    "quantize": (
        "common.model.quantization.writer",
        "write a model as a compressed-tensors checkpoint (FP8, int8, 4-bit)",
    ),
    "prefill": ("prefill_worker.main", "run a prefill worker"),
    "decode": ("decode_worker.main", "run a decode worker"),
    "router": ("router.server", "run the OpenAI-compatible router"),
    "up": ("pdserve.launcher", "start a local cluster: router, prefill and decode workers"),
    "planner": ("planner.service", "set the prefill:decode split to meet the SLOs"),
}


def usage() -> str:
    lines = ["usage: pdserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Run `pdserve <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"pdserve: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
