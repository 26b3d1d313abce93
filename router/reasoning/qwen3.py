"""vLLM's ``qwen3`` reasoning parser: ``<think>reasoning</think>answer``, as DeepSeek-R1's, and a
``<tool_call>`` ends the reasoning too (Qwen3 may call a tool straight from its thinking; the call
is then the answer's). A prompt rendered with ``enable_thinking: false`` holds an empty think
block, so the output is all answer."""

from __future__ import annotations

from router.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    answer_markers = ("<tool_call>",)
