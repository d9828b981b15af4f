"""Tokenizers by path, loaded once per process.

`models.tokenizer` holds a tokenizer.json path relative to the `sluice.models` package (its
data files ship in the wheel; absolute paths are used as they are). Loading parses the whole
vocabulary, so each file is loaded once and shared; `tokenizers.Tokenizer.encode` is
thread-safe and holds no per-call state.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer

import sluice.models

MODELS_DIR = Path(sluice.models.__file__).resolve().parent


def resolve_tokenizer_path(path: str) -> Path:
    candidate = Path(path)
    return candidate if candidate.is_absolute() else MODELS_DIR / candidate


@functools.lru_cache(maxsize=32)
def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(str(resolve_tokenizer_path(path)))


def encode(path: str, text: str) -> list[int]:
    """Token ids of `text` as the model sees it (no special tokens added around it)."""
    return list(load_tokenizer(path).encode(text, add_special_tokens=False).ids)
