"""The model's own tokenizer, with its chat template."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc

    @property
    def hf_tokenizer(self):
        """The wrapped transformers tokenizer, for callers that take fast paths through it."""
        return self._tokenizer

    def __len__(self) -> int:
        return len(self._tokenizer)

    @property
    def eos_token_id(self) -> int | None:
        return self._tokenizer.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # transformers annotates decode, apply_chat_template and convert_ids_to_tokens with what any
    # input gives, without overloads; the ignores below are for the inputs that give one type.

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text  # type: ignore[return-value]  # one id list: a str

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation to the prompt text the model was trained on; with
        ``continue_final_message`` the last message is left open for the model to go on.
        ``template_kwargs`` are more variables for the template (``documents`` among them)."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        # tokenize=False: a str.
        return self._tokenizer.apply_chat_template(  # type: ignore[return-value]
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        # The rendered template already holds the special tokens; adding BOS again would double it.
        text = self.apply_chat_template(
            messages, add_generation_prompt, continue_final_message, template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it."""
        # A list of ids: a list of str.
        return self._tokenizer.convert_ids_to_tokens(token_ids)  # type: ignore[return-value]
