"""Prompts and their token ids: one encoder for `trtspec run`, the server and `trtspec bench`.

A `Prompt` is plain text (a completion, or one user turn with chat) or chat messages (always through
the tokenizer's chat template). `encode` turns one into token ids; a prompt that needs a chat
template the tokenizer lacks is a one-line PromptError naming the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import TrtspecError


class PromptError(TrtspecError, ValueError):
    """A prompt that cannot be encoded (no chat template), or a dataset of them that cannot be read."""


@dataclass
class Prompt:
    id: str
    text: str | None = None                   # plain text (completion, or one user turn with --chat)
    messages: list[dict] | None = None        # chat messages: always through the chat template
    meta: dict = field(default_factory=dict)  # e.g. MT-Bench category

    @property
    def needs_chat(self) -> bool:
        return self.messages is not None


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(prompt: Prompt, tokenizer, chat: bool = False) -> list[int]:
    """Token ids of a prompt: raw text, or the chat template (messages, or text with chat=True)."""
    if prompt.needs_chat or chat:
        if not has_chat_template(tokenizer):
            why = "MT-Bench and chat-message prompts need" if prompt.needs_chat else "--chat needs"
            raise PromptError(f"{why} a chat template, and this model's tokenizer has none; use a model with "
                              "one, or plain-text prompts (--dataset humaneval without --chat, or a JSONL of "
                              "{\"id\", \"prompt\"})")
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):          # BatchEncoding / dict in newer transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt.text)["input_ids"]]
