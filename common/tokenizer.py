"""The model's own tokenizer, with its chat template and what its folder says about its tokens
(vocabulary size, the tokens that end a sequence, the context length): everything the router
needs of a model it runs no weights of, and what the engine and the CLI encode and decode with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from common.context_window import max_positions

# Texts longer than this are encoded by a call that releases the GIL.
LONG_TEXT_CHARS = 16_384


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
        config = _optional_json(path / "config.json")
        self.vocab_size = int(config.get("vocab_size") or len(self._tokenizer))
        self.max_position_embeddings = max_positions(config)
        self.eos_token_ids = eos_token_ids(path, config, self._tokenizer.eos_token_id)
        # The router encodes every prompt and decodes every token on its event loop: call the
        # Rust tokenizer directly where that gives transformers' own result.
        self.direct_backend = _plain_backend(self._tokenizer)

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
        if self.direct_backend is None:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if len(text) > LONG_TEXT_CHARS:
            # The batch call lets go of the GIL while it works: a long prompt encoded off the
            # event loop (see router.edge) then leaves the loop serving meanwhile.
            [encoding] = self.direct_backend.encode_batch(
                [text], add_special_tokens=add_special_tokens
            )
            return encoding.ids
        return self.direct_backend.encode(text, add_special_tokens=add_special_tokens).ids

    # transformers annotates decode, apply_chat_template and convert_ids_to_tokens with what any
    # input gives, without overloads; the ignores below are for the inputs that give one type.

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.direct_backend is not None:
            return self.direct_backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
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


def _plain_backend(tokenizer: object) -> Any:
    """The ``tokenizers.Tokenizer`` behind a transformers tokenizer, or None.

    transformers' ``encode``/``decode`` on its Rust-backed class set truncation, padding and
    special-token splitting on the backend (all off by default), call it, and clean up spaces
    after decoding only where ``clean_up_tokenization_spaces`` is set. Where the class overrides
    none of that and the settings are the defaults, calling the backend gives the same ids and
    text without the Python layers; anywhere else the calls go through transformers.
    """
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    cls = type(tokenizer)
    methods = ("encode", "_encode_plus", "set_truncation_and_padding", "decode", "_decode")
    if any(getattr(cls, m) is not getattr(TokenizersBackend, m) for m in methods):
        return None
    backend = tokenizer.backend_tokenizer
    if (
        backend.truncation is not None
        or backend.padding is not None
        or backend.encode_special_tokens
        or tokenizer.split_special_tokens
        or tokenizer.clean_up_tokenization_spaces
    ):
        return None
    return backend


def eos_token_ids(path: Path, config: dict, tokenizer_eos: int | None) -> tuple[int, ...]:
    """The tokens that end a sequence: config.json's ``eos_token_id`` (what the workers stop
    on) and generation_config.json's; the tokenizer's EOS where neither names one."""
    ids: list[int] = []
    generation = _optional_json(path / "generation_config.json")
    for source in (config, generation):
        value = source.get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    if not ids and tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    return tuple(ids)


def _optional_json(file: Path) -> dict:
    """A JSON object from ``file``, or {} where it is missing or is no JSON object."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
