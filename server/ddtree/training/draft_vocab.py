"""`ddtree draft-vocab`: the draft vocabulary a corpus suggests (its most frequent tokens), written in the
format ddtree.models.draft_vocab reads."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ddtree.errors import DDTreeError
from ddtree.models.draft_vocab import count_tokens, most_frequent, write_draft_vocab
from ddtree.training.corpus import corpus_files, encode_texts, read_texts, split_files


def build_from_corpus(target_dir: str | Path, corpus: Sequence[str | Path], size: int, out: str | Path,
                      globs: Sequence[str]) -> dict:
    """`ddtree draft-vocab`: count the target tokenizer's tokens over a local corpus (its held-out files
    excluded, so that evaluating on them stays fair) and write the `size` most frequent, stop tokens
    first. Returns what was written, less the ids, with the share of corpus tokens the vocabulary covers."""
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise DDTreeError(f"{target_dir} is not a model directory (no config.json)")
    config = AutoConfig.from_pretrained(target_dir)
    vocab_size = config.get_text_config().vocab_size
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError) as exc:
        raise DDTreeError(f"cannot load the tokenizer of {target_dir}: {exc}") from None
    stops: list[int] = []
    has_generation = (target_dir / "generation_config.json").is_file()
    generation = GenerationConfig.from_pretrained(target_dir) if has_generation else None
    for source in (config.get_text_config(), config, generation, tokenizer):
        value = getattr(source, "eos_token_id", None)
        stops += value if isinstance(value, (list, tuple)) else [value] if value is not None else []
    train, _ = split_files(corpus_files(corpus, globs))
    files = tqdm(train, unit="file", desc="ddtree draft-vocab: counting", file=sys.stderr)
    stream = encode_texts(tokenizer, read_texts(files), stops[0] if stops else 0)
    counts = count_tokens([stream], vocab_size)
    ids = most_frequent(counts, size, stops)
    covered = counts[torch.tensor(ids)].sum().item() / max(counts.sum().item(), 1)
    about = dict(counted_tokens=int(counts.sum()), counted_files=len(train), corpus_coverage=round(covered, 6))
    write_draft_vocab(out, ids, vocab_size, **about)
    print(f"ddtree draft-vocab: {len(ids)} of {vocab_size} tokens, {covered:.1%} of the {about['counted_tokens']} "
          f"corpus tokens; wrote {out}", file=sys.stderr)
    return dict(vocab_size=vocab_size, size=len(ids), **about)
