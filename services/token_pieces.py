"""Exact prompt tokenization for byte-level BPE tokenizers at a fifth of the library's CPU.

A byte-level BPE tokenizer (GPT-2's design; both shipped models use it) works in three steps:

    text ── split at added tokens ── pre-tokenize (Digits?, then the GPT-2 regex) ── BPE per piece
            "<|user|>" -> its id       " the", " quick", "'s", "  ", "1", ...           " the" -> [262]

BPE never looks past a piece, so a piece's ids are a pure function of the piece, and natural text
repeats its pieces (2,000 tokens of English are ~1,200 pieces, a few hundred distinct). The
library re-runs BPE for every piece of every prompt (~1 ms for 2,000 tokens, most of a long
prompt's Submit); here the splitting is Python's `re` (C) and each distinct piece is tokenized by
the tokenizer's own BPE model once, then remembered: 2,000 tokens in ~0.3-0.6 ms.

Words before pieces: where every space of a stretch of text stands between two printable ASCII
characters, each of those spaces starts a piece (below), so the stretch is its words, each with the
space before it (" fox.", " don't"), tokenized alone. `str.split(" ")` (C) cuts them and a second
dict remembers each word's ids already packed as the ledger stores them (ledger/token_ids.py), so
2,000 tokens of English cost one split, ~1,000 lookups and one bytes join: ~0.15-0.3 ms, half the
piece path, with no list of ints built and packed again. What the word split cannot cut beside
(`irregular_spans`: anything but printable ASCII, double spaces, a space at either end) goes into
an island, as below: an ASCII island by pieces, any other by the library. A word unseen goes
through the piece path once.

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
bounded: at most MAX_CACHED_PIECES pieces and MAX_CACHED_WORDS words (per lead) of at most
MAX_CACHED_PIECE_CHARS characters each per tokenizer (each emptied when full, added tokens kept):
~27 MB with both near full (tracemalloc, random words), ~40 MB at most. An unseen piece costs ~1 us
(the model called on it alone), so even text that never repeats (random hex) takes ~2-4x less CPU
than the library's whole-text call (bench/bench_tokenize.py).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from typing import Any

from sluice.ledger import token_ids
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
# Words with their punctuation (" fox.", " don't"), per lead: more distinct than pieces, as short.
MAX_CACHED_WORDS = 1 << 16


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


# What the word split cannot cut beside (see irregular_spans): a run of anything but printable ASCII.
NOT_PRINTABLE_ASCII_RUN = re.compile(r"[^ -~]+")
PRINTABLE_ASCII = bytes(range(ord(" "), ord("~") + 1))


def _positions(text: str, sub: str) -> list[int]:
    found, at = [], text.find(sub)
    while at != -1:
        found.append(at)
        at = text.find(sub, at + 1)
    return found


def irregular_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) spans of `text` beside which a space may stand anywhere but between two printable
    ASCII characters: its runs of characters that are not printable ASCII (other scripts, newlines,
    tabs, controls), its double spaces, a space at either end. In order; they may overlap."""
    if text.isascii():
        # bytes.translate drops every printable byte in one C pass; what is left names the others.
        others = text.encode().translate(None, PRINTABLE_ASCII).decode()
        spans = [(at, at + 1) for char in set(others) for at in _positions(text, char)]
    else:
        spans = [run.span() for run in NOT_PRINTABLE_ASCII_RUN.finditer(text)]
    spans += [(at, at + 2) for at in _positions(text, "  ")]
    if text.startswith(" "):
        spans.append((0, 1))
    if text.endswith(" "):
        spans.append((len(text) - 1, len(text)))
    spans.sort()
    return spans


def islands(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) spans of `text` holding the sorted `spans`, each reaching out to piece boundaries
    that hold whatever those characters are (see the module docstring), in order and merged where they
    touch."""
    found: list[tuple[int, int]] = []
    for span_start, span_end in spans:
        if found and span_end <= found[-1][1]:
            continue                                  # inside the island just made
        start, end = _island_start(text, span_start), _island_end(text, span_end)
        if found and start <= found[-1][1]:
            found[-1] = (found[-1][0], end)
        else:
            found.append((start, end))
    return found


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


class _RememberedWords(dict[str, bytes]):
    """Word -> its ids packed (ledger/token_ids.py), of `lead + word` (lead: the space before it, or
    none for a text's first word). A word looked up and not found is split and tokenized by `pieces`
    (the piece path: split, remembered pieces) and remembered when short; full, it empties."""

    def __init__(self, pieces: Callable[[str], list[int]], lead: str):
        super().__init__()
        self._pieces = pieces
        self._lead = lead

    def __missing__(self, word: str) -> bytes:
        packed = token_ids.pack(self._pieces(self._lead + word))
        if len(word) <= MAX_CACHED_PIECE_CHARS:
            if len(self) >= MAX_CACHED_WORDS:
                self.clear()
            self[word] = packed
        return packed


class PieceTokenizer:
    """The ids `tokenizer.encode(text, add_special_tokens=False)` gives: ASCII from remembered words
    and pieces, each non-ASCII island from the library. Build with `piece_tokenizer_from`, which
    checks the tokenizer qualifies."""

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
        self._spaced_words = _RememberedWords(self._piece_ids, " ")
        self._first_words = _RememberedWords(self._piece_ids, "")

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
        return list(token_ids.unpack(self.encode_packed(text)))

    def encode_packed(self, text: str) -> bytes:
        """`encode`'s ids as runs.prompt_token_ids stores them (ledger/token_ids.py): the stretches
        between islands word by word, each ASCII island piece by piece, the others by the library."""
        packed: list[bytes] = []
        to_library: list[tuple[int, str]] = []          # (its place in `packed`, a non-ASCII island)
        at = 0
        for start, end in islands(text, irregular_spans(text)):
            if at < start:
                packed.append(self._words(text[at:start], at == 0))
            island = text[start:end]
            if island.isascii():
                packed.append(token_ids.pack(self._piece_ids(island)))
            else:
                to_library.append((len(packed), island))
                packed.append(b"")
            at = end
        if at < len(text):
            packed.append(self._words(text[at:], at == 0))
        if to_library:
            encoded = self._tokenizer.encode_batch_fast([island for _, island in to_library],
                                                       add_special_tokens=False)
            for (place, _), encoding in zip(to_library, encoded, strict=True):
                packed[place] = token_ids.pack(encoding.ids)
        return b"".join(packed)

    def _words(self, stretch: str, first: bool) -> bytes:
        """The ids of a stretch with no irregular span: every space in it stands between two printable
        ASCII characters, so each starts a piece, and each word with the space before it is tokenized
        alone as in the whole text. The stretch starts at the text's start (`first`) or at a space."""
        words = stretch.split(" ")
        head = self._first_words[words[0]] if first else b""     # else words[0] is "" (before the space)
        return head + b"".join(map(self._spaced_words.__getitem__, itertools.islice(words, 1, None)))

    def _piece_ids(self, text: str) -> list[int]:
        return list(itertools.chain.from_iterable(map(self._cache.__getitem__, self.pieces(text))))

    def cached_pieces(self) -> int:
        return len(self._cache) - self._added_count

    def cached_words(self) -> int:
        return len(self._spaced_words) + len(self._first_words)


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

