"""A byte-level BPE tokenizer for small targets, saved so `AutoTokenizer.from_pretrained` works offline.

Byte-level means every string round-trips (no unknown token); the specials follow Qwen3: `<|endoftext|>`
ends a document and is EOS, `<|im_start|>`/`<|im_end|>` frame ChatML turns, and `<|MASK|>` is the token
DFlash drafters feed in the not-yet-known slots of a block.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
MASK = "<|MASK|>"
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>", MASK)

# ChatML, as Qwen3 uses it (without tool calls or thinking blocks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Learn byte-level BPE merges on `texts`; specials take ids 0..3."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK,
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   chat_template=CHAT_TEMPLATE, model_max_length=1 << 30)
