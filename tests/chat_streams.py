"""Streaming a chat answer through ``ChatOutput`` in chunks, and the deltas joined back: what
the parser tests compare with the whole answer's message."""

from __future__ import annotations

from router.chat_output import ChatOutput, ChatOutputPlan


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def stream(plan: ChatOutputPlan, text: str, size: int) -> tuple[str, str, list[dict]]:
    """The joined reasoning, content and calls of ``text`` streamed ``size`` characters a chunk,
    each call's first delta checked to announce it."""
    output = ChatOutput(plan)
    reasoning, content, calls = "", "", []
    pieces = chunks(text, size)
    for n, piece in enumerate(pieces):
        delta = output.delta(piece, final=n == len(pieces) - 1)
        reasoning += delta.get("reasoning", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["type"] == "function" and call["id"], call
                assert set(call["function"]) == {"name", "arguments"}, call
                calls.append({"id": call["id"], **call["function"]})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {
                    "arguments"
                }, call
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return reasoning, content, calls


def assert_stream_matches_message(plan: ChatOutputPlan, text: str) -> None:
    message = ChatOutput(plan).message(text)
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls]
    for size in (1, 2, 3, 7, 64, len(text) or 1):
        reasoning, content, calls = stream(plan, text, size)
        assert [(c["name"], c["arguments"]) for c in calls] == expected, (size, calls)
        assert (content or None) == (message.content or None), (size, content)
        assert (reasoning or None) == message.reasoning, (size, reasoning)
