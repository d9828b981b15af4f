"""Token ids → text for DELTA events, with the model's own tokenizer.

Decoding a delta's tokens alone can split a multi-byte character or drop the
space a byte-level BPE puts in front of a word, so the decoder decodes a short
window that starts a few tokens back and emits only the growth past what was
already emitted (the incremental detokenization vLLM and TGI use). Text that is
not yet a complete character (a trailing U+FFFD) is held back until the next
delta.

    tokens:  ... | prefix_offset ........ read_offset | new tokens
                   └─ context already emitted ───────┘  └─ emitted now ─┘

Each push decodes only tokens[prefix_offset:], a window of about one delta's
length, so a run's text costs O(tokens), not O(tokens²) as re-decoding the
whole run on every delta did (4,000 tokens: ~0.5 s of event-loop time).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from tokenizers import Tokenizer

import sluice.models

REPLACEMENT = "\ufffd"


@lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Tokenizer | None:
    """The model's tokenizer, the same instance admission encodes with; None when its file is
    absent (the deltas then carry token ids and no text)."""
    if not sluice.models.resolve_tokenizer_path(path).exists():
        return None
    return sluice.models.load_tokenizer(path)


WINDOW_TOKENS = 8   # the decoding window is moved on once it holds this many tokens


class IncrementalDecoder:
    """Pieces of text, one per push, that concatenate to the decode of every token pushed.

    The window (tokens[prefix_offset:]) starts at a character boundary already emitted; each push
    decodes it whole and emits what grew past `emitted`, the decode of its first part
    (tokens[prefix_offset:read_offset]). The window is moved on (prefix to read offset) only once it
    holds WINDOW_TOKENS tokens: until then the decode a push just made is the next push's `emitted`,
    so most pushes cost one decode instead of two (a decode per event of every run: the largest share
    of the driver's own work, issue 9)."""

    __slots__ = ("_tokenizer", "_tokens", "_prefix_offset", "_read_offset", "_emitted")

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._prefix_offset = 0     # start of the decoding window (context for the next piece)
        self._read_offset = 0       # tokens before this are emitted as text
        self._emitted: str | None = ""   # the decode of tokens[prefix_offset:read_offset]; None: not made

    def push(self, token_ids: Sequence[int]) -> str:
        tokenizer = self._tokenizer
        if tokenizer is None:
            return ""
        tokens = self._tokens
        tokens.extend(token_ids)
        prefix = self._prefix_offset
        emitted = self._emitted
        if emitted is None:
            emitted = self._emitted = tokenizer.decode(tokens[prefix:self._read_offset],
                                                       skip_special_tokens=True)
        text = tokenizer.decode(tokens[prefix:], skip_special_tokens=True)
        if len(text) <= len(emitted) or text.endswith(REPLACEMENT):
            return ""               # an incomplete character: wait for the bytes that finish it
        if len(tokens) - prefix >= WINDOW_TOKENS:
            self._prefix_offset, self._emitted = self._read_offset, None
        else:
            self._emitted = text
        self._read_offset = len(tokens)
        return text[len(emitted):]
