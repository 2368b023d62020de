"""Local text corpora: file discovery, a deterministic held-out split and token streams for training.

The split is decided per file by a hash of its path relative to the corpus root it was found under, so
the same file (e.g. `json/decoder.py` of two Python versions) lands on the same side on any machine.
"""

from __future__ import annotations

import fnmatch
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.errors import DDTreeError

DEFAULT_GLOBS = ("*.py", "*.txt", "*.md", "*.rst")
HOLDOUT_EVERY = 50  # one file in 50 is held out
MAX_FILE_BYTES = 512 * 1024  # bigger files are mostly generated tables
# nested installs are skipped, so a Python stdlib directory means the stdlib (pass site-packages explicitly)
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    relpath: str  # relative to the corpus root it was found under; decides the split

    @property
    def held_out(self) -> bool:
        return is_held_out(self.relpath)


def is_held_out(relpath: str) -> bool:
    return zlib.crc32(relpath.replace(os.sep, "/").encode()) % HOLDOUT_EVERY == 0


def find_files(paths: Sequence[str | Path], globs: Sequence[str] = DEFAULT_GLOBS) -> list[CorpusFile]:
    """Files named directly, plus the files under each directory whose name matches one of `globs`.

    Hidden directories, `__pycache__` and nested `site-packages`/`dist-packages` are not walked.
    """
    out: list[CorpusFile] = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(CorpusFile(p, p.name))
        elif p.is_dir():
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
                for name in sorted(names):
                    if any(fnmatch.fnmatch(name, g) for g in globs):
                        f = Path(root) / name
                        out.append(CorpusFile(f, str(f.relative_to(p))))
        else:
            raise DDTreeError(f"corpus path {p} does not exist")
    return out


def read_texts(files: Sequence[CorpusFile], max_bytes: int | None = None) -> Iterator[str]:
    """UTF-8 contents of the files, about max_bytes in all; skips unreadable, binary, empty and huge ones."""
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            return
        try:
            if f.path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = f.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() and "\x00" not in text:
            total += len(text)
            yield text


def split_files(files: Sequence[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(train, held_out)."""
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]


def encode_texts(tokenizer, texts: Iterator[str], eos_id: int, chunk: int = 2048) -> torch.Tensor:
    """One int32 stream of all texts, each followed by EOS; encoded in parallel batches by `tokenizers`."""
    backend = tokenizer.backend_tokenizer
    parts: list[torch.Tensor] = []
    batch: list[str] = []

    def flush() -> None:
        for enc in backend.encode_batch(batch, add_special_tokens=False):
            parts.append(torch.tensor([*enc.ids, eos_id], dtype=torch.int32))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == chunk:
            flush()
    if batch:
        flush()
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


class TokenStream:
    """A flat token stream sampled as random windows (documents joined by EOS, as in LM pre-training)."""

    def __init__(self, tokens: torch.Tensor, device: torch.device | str = "cpu") -> None:
        self.tokens = tokens.to(device)

    def __len__(self) -> int:
        return self.tokens.numel()

    def windows(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[batch, length] int64 windows starting at uniform random offsets."""
        if len(self) <= length:
            raise DDTreeError(f"the corpus has {len(self)} tokens, fewer than one training window of {length + 1}")
        starts = torch.randint(0, len(self) - length, (batch,), generator=generator)
        idx = starts[:, None] + torch.arange(length)[None, :]
        return self.tokens[idx.to(self.tokens.device)].long()


def corpus_files(paths: Sequence[str | Path], globs: Sequence[str]) -> list[CorpusFile]:
    """find_files, with an error when nothing trainable is found."""
    files = find_files(paths, globs)
    if not split_files(files)[0]:
        raise DDTreeError(f"no corpus files matching {', '.join(globs)} under {', '.join(map(str, paths))}")
    return files


def load_streams(tokenizer, files: Sequence[CorpusFile], eos_id: int,
                 device: torch.device | str) -> tuple[TokenStream, TokenStream]:
    """(train, held_out) token streams of the corpus files."""
    train_files, held_files = split_files(files)
    train = encode_texts(tokenizer, read_texts(train_files), eos_id)
    held = encode_texts(tokenizer, read_texts(held_files), eos_id)
    if held.numel() == 0:  # tiny corpora: hold out the stream's last 5% instead of whole files
        cut = int(train.numel() * 0.95)
        train, held = train[:cut], train[cut:]
    return TokenStream(train, device), TokenStream(held, device)
