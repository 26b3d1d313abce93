"""vLLM's own OpenAI-server tests of structured outputs and tool calls, run unchanged against a
server that is already up: `pdserve up`, or `vllm serve` for comparison.

vLLM's tests start their own server through ``tests.utils.RemoteOpenAIServer``. This writes a
pytest plugin into a temporary folder that replaces that class, before any test module imports
it, with one that points at ``--base-url`` and sends every request with ``--model`` as its model
(the tests name the model they were written for); ``hf_api().snapshot_download`` returns
``--model-folder``, so nothing is downloaded. The tests come from ``--vllm-src`` (vLLM's source
tree at the installed version: its sdist has ``tests/``), copied out beside the plugin so that
``vllm`` is the installed package, not the tree's. Each selected file runs in its own pytest, with
the given Python (one that imports vllm, with pytest, pytest-asyncio and tblib). One line per
file (summed over ``--rounds``: many cases sample at temperature 1), then the total, e.g.::

    chat_completion/test_chat.py                      passed   7  failed  1  skipped  0

    python -m benchmarks.quality.vllm_server_tests --vllm-src /tmp/vllm-src \\
        --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \\
        --python ~/vllm-venv/bin/python [--files tool_use/test_tool_calls.py ...]

Start the server with ``--enable-auto-tool-choice --tool-call-parser hermes``: the tool files
were written for a server started so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from common.model.default_model import resolve_model_path

TESTS = "tests/entrypoints/openai/"


@dataclass(frozen=True)
class Selection:
    path: str  # under tests/
    pytest_args: tuple[str, ...]  # which cases of the file


# Files in: the cases that ask a running server for structured outputs or tool calls.
SELECTED = (
    # structured_outputs choice/json/regex (and their type error, with logprobs), response_format
    # json_object/json_schema/text; the rest of the file is logprobs, LoRA, sessions.
    Selection(
        TESTS + "chat_completion/test_chat.py", ("-k", "structured_outputs or response_format")
    ),
    # invalid JSON schema, regex and grammar, and an empty grammar: each a 400.
    Selection(
        TESTS + "chat_completion/test_chat_completion.py", ("-k", "invalid or empty_grammar")
    ),
    # the same three invalid structured outputs on /v1/completions.
    Selection(TESTS + "completion/test_completion.py", ("-k", "invalid")),
    # tool_choice auto/required/named, streamed or not, no-argument calls, a named tool that is
    # not among tools, max_tokens with required; not the watermarked server (another start).
    Selection(
        TESTS + "chat_completion/test_completion_with_function_calling.py",
        ("-k", "not watermarked"),
    ),
    # chat without tools, with tools, response_format beside tool_choice required (hermes config).
    Selection("tests/tool_use/test_chat_completions.py", ("--models", "hermes")),
    # a tool call streamed and not, then answering with its result (hermes config).
    Selection("tests/tool_use/test_tool_calls.py", ("--models", "hermes")),
    # parallel calls, their results, and parallel_tool_calls false (hermes config).
    Selection("tests/tool_use/test_parallel_tool_calls.py", ("--models", "hermes")),
)
# Files out, and why:
LEFT_OUT = {
    TESTS + "responses/": "the Responses API, which pdserve does not serve",
    TESTS + "chat_completion/test_batched_chat_completions.py": "/v1/chat/completions/batch",
    TESTS + "chat_completion/test_chat_error.py": "vLLM's serving classes on a mocked engine",
    TESTS + "completion/test_completion_error.py": "vLLM's serving classes on a mocked engine",
    TESTS + "test_tool_choice_content_none.py": "vLLM's parser classes, no server",
    TESTS + "test_tool_calls_serialization.py": "vLLM's protocol classes, no server",
    "tests/tool_use/test_tool_choice_required.py": "vLLM's tool-schema helpers, no server",
    "tests/tool_use/mistral/": "Mistral's tokenizer and parser",
    "tests/tool_parsers/": "each parser class alone, no server",
}

PLUGIN = '''
import json
import os

import httpx
import pytest

import vllm.transformers_utils.repo_utils as repo_utils

BASE_URL = os.environ["VLLM_TESTS_BASE_URL"].rstrip("/")
MODEL = os.environ["VLLM_TESTS_MODEL"]
MODEL_FOLDER = os.environ["VLLM_TESTS_MODEL_FOLDER"]


class _LocalHub:
    def snapshot_download(self, *args, **kwargs):
        return MODEL_FOLDER


repo_utils.hf_api = lambda *args, **kwargs: _LocalHub()

import tests.utils  # noqa: E402  (after the patch: tests' conftests import hf_api by name)


def _renamed(request):
    """The request with MODEL as the JSON body's model, if it has one."""
    if request.headers.get("content-type", "").startswith("application/json"):
        body = json.loads(request.read() or b"null")
        if isinstance(body, dict) and "model" in body:
            body["model"] = MODEL
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            return httpx.Request(request.method, request.url, headers=headers, json=body)
    return request


class _Renaming(httpx.HTTPTransport):
    def handle_request(self, request):
        return super().handle_request(_renamed(request))


class _AsyncRenaming(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request):
        return await super().handle_async_request(_renamed(request))


class RunningServer(tests.utils.RemoteOpenAIServer):
    """The server at BASE_URL in place of a new `vllm serve`; its arguments are ignored."""

    def __init__(self, *args, **kwargs):
        url = httpx.URL(BASE_URL)
        self.host, self.port, self.uds = url.host, url.port, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def get_client(self, **kwargs):
        return super().get_client(http_client=httpx.Client(transport=_Renaming()), **kwargs)

    def get_async_client(self, **kwargs):
        client = httpx.AsyncClient(transport=_AsyncRenaming())
        return super().get_async_client(http_client=client, **kwargs)


tests.utils.RemoteOpenAIServer = RunningServer
'''


def run_file(
    python: str, workdir: Path, selection: Selection, env: dict[str, str]
) -> tuple[int, int, int]:
    """Passed, failed (errors included), skipped for one file's selected cases."""
    report = workdir / "report.xml"
    report.unlink(missing_ok=True)
    command = [python, "-m", "pytest", "-p", "vllm_tests_shim", "-p", "no:cacheprovider"]
    command += ["-q", f"--junitxml={report}", selection.path, *selection.pytest_args]
    subprocess.run(command, cwd=workdir, env=env, stdout=sys.stderr, check=False)
    if not report.exists():
        return 0, 1, 0
    root = ElementTree.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return 0, 1, 0
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = counts["failures"] + counts["errors"]
    return counts["tests"] - failed - counts["skipped"], failed, counts["skipped"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-src", type=Path, required=True, help="vLLM's source tree")
    parser.add_argument("--base-url", required=True, help="the running server, http://HOST:PORT")
    parser.add_argument("--model", required=True, help="the name the server answers to")
    parser.add_argument("--model-folder", type=Path, default=None, help="default: SmolLM2's")
    parser.add_argument("--python", default=sys.executable, help="a Python that imports vllm")
    parser.add_argument("--files", nargs="+", default=None, help="paths under tests/, or parts")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each file, counts summed (answers are sampled)",
    )
    args = parser.parse_args()
    chosen = [s for s in SELECTED if args.files is None or any(f in s.path for f in args.files)]
    with tempfile.TemporaryDirectory(prefix="vllm-tests-") as name:
        workdir = Path(name)
        shutil.copytree(args.vllm_src / "tests", workdir / "tests")
        shutil.copy(args.vllm_src / "pyproject.toml", workdir)  # pytest's markers
        (workdir / "vllm_tests_shim.py").write_text(PLUGIN)
        env = dict(os.environ)
        env.update(
            PYTHONPATH=name,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_TESTS_BASE_URL=args.base_url,
            VLLM_TESTS_MODEL=args.model,
            VLLM_TESTS_MODEL_FOLDER=str(resolve_model_path(args.model_folder)),
        )
        totals = [0, 0, 0]
        for selection in chosen:
            counts = [0, 0, 0]
            for _ in range(args.rounds):
                run = run_file(args.python, workdir, selection, env)
                counts = [c + r for c, r in zip(counts, run, strict=True)]
            totals = [t + c for t, c in zip(totals, counts, strict=True)]
            name = selection.path.removeprefix(TESTS).removeprefix("tests/")
            print(f"{name:<58} passed {counts[0]:3}  failed {counts[1]:2}  skipped {counts[2]:2}")
        print(f"{'total':<58} passed {totals[0]:3}  failed {totals[1]:2}  skipped {totals[2]:2}")


if __name__ == "__main__":
    main()
