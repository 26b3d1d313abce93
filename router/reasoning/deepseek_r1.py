"""vLLM's ``deepseek_r1`` reasoning parser: ``<think>reasoning</think>answer``, the opening
marker optional (DeepSeek-R1's template writes it into the prompt)."""

from __future__ import annotations

from router.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    pass
