"""Token ids → text for DELTA events, with the model's own tokenizer.

Decoding a delta's tokens alone can split a multi-byte character or drop the
space a byte-level BPE puts in front of a word, so the decoder keeps the run's
tokens and emits the growth of the decoded text instead. Text that is not yet
a complete character (a trailing U+FFFD) is held back until the next delta.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer

from services import tokenization

REPLACEMENT = "\ufffd"


@lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Tokenizer | None:
    """The model's tokenizer, the same instance admission encodes with; None when its file is
    absent (the deltas then carry token ids and no text)."""
    if not tokenization.resolve_tokenizer_path(path).exists():
        return None
    return tokenization.load_tokenizer(path)


class IncrementalDecoder:
    __slots__ = ("_tokenizer", "_tokens", "_emitted")

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._emitted = ""

    def push(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            return ""
        self._tokens.extend(token_ids)
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        stable = text.rstrip(REPLACEMENT)
        if not stable.startswith(self._emitted):
            # The decoder rewrote earlier text (normalisation); emit this delta on its own.
            piece = self._tokenizer.decode(token_ids, skip_special_tokens=True)
            self._emitted = stable
            return piece
        piece, self._emitted = stable[len(self._emitted):], stable
        return piece
