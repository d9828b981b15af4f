"""Model data files shipped as package resources (tokenizer.json, chat.json), found by path.

A model's `tokenizer` column holds a path relative to this package (absolute paths are used as
they are). Loading parses the whole vocabulary, so each file is parsed once per process.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer

MODELS_DIR = Path(__file__).resolve().parent


def resolve_tokenizer_path(path: str) -> Path:
    candidate = Path(path)
    return candidate if candidate.is_absolute() else MODELS_DIR / candidate


@functools.lru_cache(maxsize=32)
def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(str(resolve_tokenizer_path(path)))
