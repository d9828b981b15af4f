"""Exact prompt tokenization for byte-level BPE tokenizers at a quarter of the library's CPU.

A byte-level BPE tokenizer (GPT-2's design; both shipped models use it) works in three steps:

    text ── split at added tokens ── pre-tokenize (Digits?, then the GPT-2 regex) ── BPE per piece
            "<|user|>" -> its id       " the", " quick", "'s", "  ", "1", ...           " the" -> [262]

BPE never looks past a piece, so a piece's ids are a pure function of the piece, and natural text
repeats its pieces (2,000 tokens of English are ~1,200 pieces, a few hundred distinct). The
library re-runs BPE for every piece of every prompt (~1 ms for 2,000 tokens, most of a long
prompt's Submit); here the splitting is Python's `re` (C) and each distinct piece is tokenized by
the tokenizer's own BPE model once, then remembered: 2,000 tokens in ~0.3-0.6 ms.

Exact by construction, not by approximation: the ids of every piece come from the tokenizer's own
model, and the split reproduces the library's pre-tokenizer for the configurations accepted by
`piece_tokenizer_from` (anything else goes to the library whole):
- no normalizer; added tokens matched as they are written (no lstrip/rstrip/single_word, not
  normalized), leftmost-longest, as the library's Aho-Corasick pass does;
- pre-tokenizer ByteLevel(use_regex, no prefix space), optionally after Digits: on ASCII the GPT-2
  pattern's classes are exactly \\p{L} = [A-Za-z], \\p{N} = [0-9], \\s = [ \\t\\n\\v\\f\\r]
  (Unicode White_Space); other scripts' classes depend on the regex engines' Unicode tables, so
  non-ASCII text is never split here: each run of it goes to the library within an "island" that
  reaches out to the nearest space standing between two printable ASCII characters on each side.
  Such a space always starts a piece (no alternative of the pattern matches a non-space followed by a
  space, and " x" starts one for any non-space x), whatever the tables say about the characters
  further away, so the library's ids for an island alone are its ids in the whole text (added tokens
  hold no whitespace, so none straddles an island's edge);
- a BPE model without dropout (deterministic per piece).
tests/test_token_pieces.py compares every path with the library's plain `encode` on random ASCII
built to hit each branch of the pattern (contractions, whitespace runs before words, digits,
control characters, added tokens inside words) and on ASCII mixed with other scripts, Unicode
spaces, smart quotes, combining marks and emoji.

One PieceTokenizer is shared by a process and used from its event loop's thread only (a prompt
sent to a worker thread, services/tokenization.py, is one the library encodes). The memory is
bounded: at most MAX_CACHED_PIECES pieces of at most MAX_CACHED_PIECE_CHARS characters each per
tokenizer (emptied when full, added tokens kept). An unseen piece costs ~1 us (the model called on
it alone), so even text that never repeats (random hex) takes ~2-4x less CPU than the library's
whole-text call (bench/bench_tokenize.py).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from tokenizers import Tokenizer
from tokenizers.models import Model

# The GPT-2 pre-tokenizer pattern (tokenizers' ByteLevel, use_regex=True:
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ )
# with its Unicode classes written out for ASCII text. Words and numbers are tried before the
# contractions (a third less time in `re`, which tries alternatives in order): no contraction
# starts where a word or a number can, so every position matches the same alternative.
GPT2_PATTERN_ASCII = re.compile(
    r""" ?[A-Za-z]+| ?[0-9]+|'(?:[stmd]|re|ve|ll)| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""", re.ASCII)
DIGIT_EACH = re.compile(r"([0-9])")
DIGIT_RUNS = re.compile(r"([0-9]+)")

# ~64k pieces of <= 64 characters: ~22 MB per tokenizer per process when full (tracemalloc, random
# words of 3-12 letters), far more distinct pieces than a language's common words (the model's
# 670 KB corpus has ~12k), so the cache is emptied only under unusual text.
MAX_CACHED_PIECES = 1 << 16
MAX_CACHED_PIECE_CHARS = 64


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table (tokenizers' ByteLevel): printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable},
            **{byte: chr(256 + rank) for rank, byte in enumerate(others)}}


# An ASCII piece's byte-level form, for str.translate (an ASCII character is its one byte).
BYTE_LEVEL_ASCII = {byte: char for byte, char in _gpt2_bytes_to_unicode().items() if byte < 128}


def _is_graph(char: str) -> bool:
    return "!" <= char <= "~"


def _island_start(text: str, at: int) -> int:
    """The last space before `at` that stands between two printable ASCII characters, or 0."""
    space = text.rfind(" ", 0, at)
    while space > 0 and not (_is_graph(text[space - 1]) and _is_graph(text[space + 1])):
        space = text.rfind(" ", 0, space)
    return max(space, 0)


def _island_end(text: str, at: int) -> int:
    """The first space from `at` on that stands between two printable ASCII characters, or the end."""
    space = text.find(" ", at)
    while space != -1 and not (0 < space < len(text) - 1 and _is_graph(text[space - 1])
                               and _is_graph(text[space + 1])):
        space = text.find(" ", space + 1)
    return len(text) if space == -1 else space


NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")


def non_ascii_islands(text: str) -> list[tuple[int, int]]:
    """[start, end) spans of `text` holding its non-ASCII characters, each reaching out to piece
    boundaries that hold whatever those characters are (see the module docstring), in order and
    merged where they touch."""
    islands: list[tuple[int, int]] = []
    for run in NON_ASCII_RUN.finditer(text):
        if islands and run.start() < islands[-1][1]:
            continue                                  # inside the island just made
        start, end = _island_start(text, run.start()), _island_end(text, run.end())
        if islands and start <= islands[-1][1]:
            islands[-1] = (islands[-1][0], end)
        else:
            islands.append((start, end))
    return islands


class _RememberedPieces(dict[str, list[int]]):
    """Piece -> ids. A piece looked up and not found is tokenized by the tokenizer's own BPE model on
    its byte-level form (what its ByteLevel pre-tokenizer hands the model: ~1 us, where the
    library's encode costs ~4 us per piece) and remembered when short (`__missing__`: the lookup of
    a remembered piece stays dict's own, in C). Full, it empties down to the added tokens."""

    def __init__(self, model: Model, added_ids: dict[str, list[int]]):
        super().__init__(added_ids)
        self._tokenize = model.tokenize
        self._added_ids = added_ids
        self._limit = MAX_CACHED_PIECES + len(added_ids)

    def __missing__(self, piece: str) -> list[int]:
        ids = [token.id for token in self._tokenize(piece.translate(BYTE_LEVEL_ASCII))]
        if len(piece) <= MAX_CACHED_PIECE_CHARS:
            if len(self) >= self._limit:
                self.clear()
                self.update(self._added_ids)
            self[piece] = ids
        return ids


class PieceTokenizer:
    """The ids `tokenizer.encode(text, add_special_tokens=False)` gives: ASCII from remembered
    pieces, each non-ASCII island from the library. Build with `piece_tokenizer_from`, which checks
    the tokenizer qualifies."""

    def __init__(self, tokenizer: Tokenizer, added_tokens: list[str], digits: re.Pattern[str] | None):
        self._tokenizer = tokenizer
        # Longest first: at a position, `re` takes the first alternative that matches.
        alternatives = sorted(added_tokens, key=len, reverse=True)
        self._added = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        self._digits = digits
        # Added tokens are pieces of their own, remembered for good (kept when the cache empties).
        added_ids = {content: [_id_of(tokenizer, content)] for content in added_tokens}
        self._cache = _RememberedPieces(tokenizer.model, added_ids)
        self._added_count = len(added_ids)

    def takes(self, text: str) -> bool:
        """Whether `text` is mostly ASCII: at most one byte in 16 of its UTF-8 comes from characters
        beyond it (a text in another script goes to the library whole, in a thread when long)."""
        return text.isascii() or len(text.encode(errors="surrogatepass")) - len(text) <= len(text) // 16

    def pieces(self, text: str) -> list[str]:
        """`text` split as the tokenizer's added-token pass and pre-tokenizer split it."""
        parts = self._added.split(text) if self._added is not None else [text]
        pieces: list[str] = []
        for index, part in enumerate(parts):
            if index % 2:                        # an added token: one piece, its own id
                pieces.append(part)
            elif self._digits is None:
                pieces += GPT2_PATTERN_ASCII.findall(part)
            else:
                for digits_index, segment in enumerate(self._digits.split(part)):
                    if digits_index % 2:
                        pieces.append(segment)
                    elif segment:
                        pieces += GPT2_PATTERN_ASCII.findall(segment)
        return pieces

    def encode(self, text: str) -> list[int]:
        if text.isascii():
            return self._encode_ascii(text)
        islands = non_ascii_islands(text)
        encoded = self._tokenizer.encode_batch_fast([text[start:end] for start, end in islands],
                                                   add_special_tokens=False)
        ids: list[int] = []
        at = 0
        for (start, end), encoding in zip(islands, encoded, strict=True):
            if at < start:
                ids += self._encode_ascii(text[at:start])
            ids += encoding.ids
            at = end
        if at < len(text):
            ids += self._encode_ascii(text[at:])
        return ids

    def _encode_ascii(self, text: str) -> list[int]:
        return list(itertools.chain.from_iterable(map(self._cache.__getitem__, self.pieces(text))))

    def cached_pieces(self) -> int:
        return len(self._cache) - self._added_count


def _id_of(tokenizer: Tokenizer, added_token: str) -> int:
    token_id = tokenizer.token_to_id(added_token)
    assert token_id is not None, f"added token {added_token!r} has no id in its own tokenizer"
    return token_id


def _digits_splitter(step: dict[str, Any]) -> re.Pattern[str] | None:
    return DIGIT_EACH if step.get("individual_digits") else DIGIT_RUNS


def _byte_level_ok(step: dict[str, Any]) -> bool:
    return (step.get("type") == "ByteLevel" and step.get("use_regex", True) is True
            and not step.get("add_prefix_space", False))


def _pre_tokenizer(spec: dict[str, Any] | None) -> tuple[bool, re.Pattern[str] | None]:
    """(supported, the Digits splitter or None) for a tokenizer.json pre_tokenizer."""
    if spec is None:
        return False, None
    if spec.get("type") == "Sequence":
        steps = spec.get("pretokenizers", [])
        if len(steps) == 2 and steps[0].get("type") == "Digits" and _byte_level_ok(steps[1]):
            return True, _digits_splitter(steps[0])
        return False, None
    return _byte_level_ok(spec), None


def _added_tokens_ok(added: list[dict[str, Any]]) -> bool:
    return all(not (token.get("lstrip") or token.get("rstrip") or token.get("single_word")
                    or token.get("normalized") or any(char.isspace() for char in token["content"]))
               for token in added)


def _model_ok(model: dict[str, Any]) -> bool:
    return model.get("type") == "BPE" and model.get("dropout") is None


def configuration_of(tokenizer: Tokenizer) -> dict[str, Any]:
    """The fields of a tokenizer.json that `piece_tokenizer_from` reads, from the loaded tokenizer
    (the file's vocabulary is not parsed a second time: ~60 ms for SmolLM2's 1.5 MB)."""
    def state(component: Any) -> dict[str, Any] | None:
        return None if component is None else json.loads(component.__getstate__())

    decoder = tokenizer.get_added_tokens_decoder()
    added = [decoder[token_id] for token_id in sorted(decoder)]
    return {
        "normalizer": state(tokenizer.normalizer),
        "pre_tokenizer": state(tokenizer.pre_tokenizer),
        "added_tokens": [{"content": token.content, "lstrip": token.lstrip, "rstrip": token.rstrip,
                          "single_word": token.single_word, "normalized": token.normalized}
                         for token in added],
        "model": {"type": type(tokenizer.model).__name__,
                  "dropout": getattr(tokenizer.model, "dropout", None)},
    }


def piece_tokenizer_from(tokenizer: Tokenizer, config: dict[str, Any]) -> PieceTokenizer | None:
    """A PieceTokenizer for `tokenizer` (its tokenizer.json as `config`), or None when its
    configuration is one this module does not reproduce exactly."""
    supported, digits = _pre_tokenizer(config.get("pre_tokenizer"))
    added = config.get("added_tokens", [])
    if not (supported and config.get("normalizer") is None and _added_tokens_ok(added)
            and _model_ok(config.get("model", {}))):
        return None
    return PieceTokenizer(tokenizer, [token["content"] for token in added], digits)

