"""Text in and out of token ids, through the target's tokenizer: one rendering for the CLI, the engine and the
server's front end (which holds the tokenizer but not the models when the engine runs in its own process)."""

from __future__ import annotations

from collections.abc import Sequence

from ddtree.errors import DDTreeError


class TextCodec:
    """Encoding, chat rendering and decoding over `self.tokenizer` (None: a token-id-only checkpoint)."""

    tokenizer: object | None

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise DDTreeError("the target has no tokenizer; pass token ids (--prompt-ids) instead of text")
        if chat:
            return self.chat_ids([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_ids(self, messages: list[dict], *, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, **template_kwargs: object) -> list[int]:
        """Prompt ids of a chat through the tokenizer's template."""
        return list(self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt and not continue_final_message, **template_kwargs))

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
