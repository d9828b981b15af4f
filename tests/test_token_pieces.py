"""Prompt tokenization from remembered pieces (services/token_pieces.py) against the oracle: the
`tokenizers` library's own plain `encode` of the whole text, on both shipped tokenizers."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import random
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sluice.services import token_pieces, tokenization
from sluice.services.token_pieces import (
    PieceTokenizer,
    configuration_of,
    irregular_spans,
    islands,
    piece_tokenizer_from,
)
from tokenizers import Tokenizer

from sluice.models import MODELS_DIR, load_tokenizer, resolve_tokenizer_path

TINY_CHAT = "tiny-chat/tokenizer.json"          # ByteLevel pre-tokenizer
SMOLLM2 = "smollm2-135m-instruct/tokenizer.json"  # Digits(individual) then ByteLevel
TOKENIZERS = [TINY_CHAT, SMOLLM2]

ASCII = "".join(map(chr, range(128)))
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'", "''", "'x"]
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\x0b", "\x0c", " \n ", "\t "]
CONTROL = ["\x00", "\x1c", "\x1d", "\x1e", "\x1f", "\x7f", "\x08"]


@functools.cache
def config_of(path: str) -> dict:
    return json.loads(resolve_tokenizer_path(path).read_text())


def library_ids(path: str, text: str) -> list[int]:
    return load_tokenizer(path).encode(text, add_special_tokens=False).ids


def added_tokens(path: str) -> list[str]:
    return [token["content"] for token in config_of(path)["added_tokens"]]


def fresh(path: str) -> PieceTokenizer:
    pieces = piece_tokenizer_from(load_tokenizer(path), config_of(path))
    assert pieces is not None, f"{path} should qualify for piece tokenization"
    return pieces


@functools.cache
def splitter(path: str) -> PieceTokenizer:
    return fresh(path)


def ids_of_the_pieces(path: str, text: str) -> list[int]:
    """The claim the module rests on: the text's ids are its pieces' ids, each piece tokenized
    alone by the library, concatenated (no cache involved)."""
    pieces = splitter(path).pieces(text)
    encoded = load_tokenizer(path).encode_batch(pieces, add_special_tokens=False) if pieces else []
    return list(itertools.chain.from_iterable(encoding.ids for encoding in encoded))


@pytest.mark.parametrize("path", TOKENIZERS)
def test_every_string_of_up_to_two_ascii_characters_splits_and_encodes_as_the_library_does(path: str) -> None:
    texts = list(ASCII) + [a + b for a in ASCII for b in ASCII]
    assert [text for text in texts if ids_of_the_pieces(path, text) != library_ids(path, text)] == []
    pieces = fresh(path)   # every byte's byte-level form through the model, then from the cache
    assert [text for text in texts + texts if pieces.encode(text) != library_ids(path, text)] == []


@pytest.mark.parametrize("path", TOKENIZERS)
def test_every_string_of_three_boundary_characters_in_context_splits_as_the_library_does(path: str) -> None:
    # One character of each class the pattern tells apart, in every order of three, between words.
    boundary = "a Z 7 ' s \t \n \x0b \x0c \r . \x1c \x00 < |".split(" ") + [" "]
    texts = ["x" + "".join(triple) + "y" for triple in itertools.product(boundary, repeat=3)]
    texts += ["".join(triple) for triple in itertools.product(boundary, repeat=3)]
    assert [text for text in texts if ids_of_the_pieces(path, text) != library_ids(path, text)] == []


def ascii_fragments(path: str) -> st.SearchStrategy[str]:
    words = st.text(alphabet=string.ascii_letters, min_size=1, max_size=12)
    numbers = st.text(alphabet=string.digits, min_size=1, max_size=6)
    added = added_tokens(path)
    halves = [token[: len(token) // 2] for token in added] + [token[len(token) // 2:] for token in added]
    return st.one_of(words, numbers, st.sampled_from(CONTRACTIONS + WHITESPACE + CONTROL),
                     st.sampled_from(added + halves), st.text(alphabet=ASCII, max_size=4),
                     st.sampled_from(list(string.punctuation)))


@pytest.mark.parametrize("path", TOKENIZERS)
def test_random_ascii_texts_match_the_library_split_and_cached(path: str) -> None:
    shared = fresh(path)   # one cache across examples: later examples hit pieces learnt earlier

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.lists(ascii_fragments(path), max_size=40).map("".join))
    def check(text: str) -> None:
        expected = library_ids(path, text)
        assert ids_of_the_pieces(path, text) == expected
        assert shared.encode(text) == expected
        assert shared.encode(text) == expected       # the second time every piece is remembered

    check()


@pytest.mark.parametrize("path", TOKENIZERS)
def test_the_training_corpus_in_chunks_matches_the_library(path: str) -> None:
    text = (MODELS_DIR / "corpus.txt").read_text()
    pieces = fresh(path)
    chunks = [text[start:start + 4_000] for start in range(0, len(text), 4_000)]
    ascii_chunks = [chunk for chunk in chunks if pieces.takes(chunk)]
    assert len(ascii_chunks) > len(chunks) // 2          # the test exercises the piece path
    for chunk in ascii_chunks:
        assert pieces.encode(chunk) == library_ids(path, chunk)
    assert pieces.cached_pieces() > 1_000                 # and its cache, not only the fallback


@pytest.mark.parametrize("path", TOKENIZERS)
def test_the_service_encodes_chat_wrapped_prompts_exactly(path: str) -> None:
    prompt = "Summarise: the 3 rivers' deltas (1984-2024) don't move;\n\n  they're 'stable'. " * 40
    expected = library_ids(path, tokenization.model_input(path, prompt))
    assert tokenization.load_piece_tokenizer(path) is not None
    assert tokenization.encode(path, prompt) == expected
    assert tokenization.encode(path, prompt) == expected


@pytest.mark.parametrize("path", TOKENIZERS)
def test_text_mostly_in_another_script_goes_to_the_library_whole(path: str) -> None:
    text = "naïve café — 12345 tokens! 🙂 東京 ＡＢＣ Ⅻ"
    assert not fresh(path).takes(text)
    assert tokenization.encode(path, text, wrap=False) == library_ids(path, text)


def islands_of(text: str) -> list[tuple[int, int]]:
    return islands(text, irregular_spans(text))


def test_an_island_reaches_out_to_spaces_between_printable_ascii() -> None:
    #          0123456789012345
    text = "the café is open"
    assert islands_of(text) == [(3, 11)]                     # " café is": the space at 8 follows é
    assert islands_of("a “quoted” word") == [(0, 15)]        # no such space on either side
    assert islands_of("x — y and z é w") == [(0, 5), (9, 15)]      # " z é w": 11 is beside é
    assert islands_of("é  é") == [(0, 4)]                    # a space beside a space is no edge
    assert islands_of("plain words only") == []
    # ASCII the word split cannot cut beside: double spaces, newlines and controls, the ends.
    assert islands_of("a  b c") == [(0, 4)]                  # "a  b", up to the space between b and c
    assert islands_of("one x\ny two") == [(3, 7)]            # " x\ny", from the spaces around it
    assert islands_of("x\x00y z") == [(0, 3)]
    assert islands_of(" lead and trail ") == [(0, 5), (9, 16)]
    assert islands_of("tab\there and\tthere too") == [(0, 18)]     # (0, 8) and (8, 18) touch: merged


def test_irregular_spans_name_what_the_word_split_cannot_cut_beside() -> None:
    assert irregular_spans("a  b\n c\té") == [(1, 3), (4, 5), (7, 9)]      # not ASCII: runs
    assert irregular_spans("a\n\nb  ") == [(1, 2), (2, 3), (4, 6), (5, 6)]
    assert irregular_spans("naïve  x") == [(2, 3), (5, 7)]
    assert irregular_spans("plain words") == []


NON_ASCII = ["é", "café", "naïve", "’", "“", "”", "—", "…", "\u00a0", "\u2003", "\u2028", "e\u0301",
             "🙂", "東京", "Ⅻ", "١٢٣", "ＡＢＣ", "ß", "İ", "\u200b", "\ufeff", "\x85", "\u3000"]


@pytest.mark.parametrize("path", TOKENIZERS)
def test_ascii_mixed_with_other_scripts_matches_the_library(path: str) -> None:
    shared = fresh(path)
    fragments = st.one_of(ascii_fragments(path), st.sampled_from(NON_ASCII))

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.lists(fragments, max_size=40).map("".join))
    def check(text: str) -> None:
        expected = library_ids(path, text)
        assert shared.encode(text) == expected
        assert shared.encode(text) == expected

    check()


@pytest.mark.parametrize("path", TOKENIZERS)
def test_non_ascii_characters_around_each_ascii_boundary_match_the_library(path: str) -> None:
    pieces = fresh(path)
    boundary = ["a", "7", " ", "  ", "'", ".", "\n", "'s", " x", "x "]
    texts = [f"one two {left}{odd}{right} three four" for odd in NON_ASCII
             for left in boundary for right in boundary]
    texts += [f"one {first}{middle}{second} two" for first in NON_ASCII for second in NON_ASCII
              for middle in boundary]
    assert [text for text in texts if pieces.encode(text) != library_ids(path, text)] == []


def test_text_that_never_repeats_is_exact_and_remembered_within_bounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_pieces, "MAX_CACHED_PIECES", 500)
    pieces = fresh(TINY_CHAT)
    rng = random.Random(7)
    for _ in range(5):
        noise = " ".join("".join(rng.choices(string.hexdigits, k=12)) for _ in range(300))
        assert pieces.encode(noise) == library_ids(TINY_CHAT, noise)
        assert 0 < pieces.cached_pieces() <= 500


def test_the_cache_is_emptied_when_full_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_pieces, "MAX_CACHED_PIECES", 16)
    pieces = fresh(TINY_CHAT)
    special = "<|user|>"
    assert pieces.encode(special) == [load_tokenizer(TINY_CHAT).token_to_id(special)]
    rng = random.Random(11)
    words = ["".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(40)]
    for round_ in range(30):
        text = " ".join(rng.choices(words[:4], k=20) + rng.choices(words, k=2))
        assert pieces.encode(text) == library_ids(TINY_CHAT, text), round_
        assert pieces.cached_pieces() <= 16
    assert pieces.encode(special + "hi") == library_ids(TINY_CHAT, special + "hi")   # kept through it

def test_long_pieces_are_not_remembered() -> None:
    pieces = fresh(TINY_CHAT)
    long_word = "a" * (token_pieces.MAX_CACHED_PIECE_CHARS + 1)
    text = "the cat " * 3 + long_word
    assert pieces.encode(text) == library_ids(TINY_CHAT, text)
    assert pieces.pieces(text) == ["the"] + [" cat", " the"] * 2 + [" cat", " " + long_word]
    assert pieces.cached_pieces() == 3                    # "the", " cat", " the"


def unsupported(change: str) -> dict:
    config = copy.deepcopy(config_of(SMOLLM2))
    if change == "normalizer":
        config["normalizer"] = {"type": "NFC"}
    elif change == "prefix space":
        config["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True
    elif change == "no regex":
        config["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = False
    elif change == "other pre-tokenizer":
        config["pre_tokenizer"]["pretokenizers"][0] = {"type": "Punctuation", "behavior": "Isolated"}
    elif change == "lstrip":
        config["added_tokens"][1]["lstrip"] = True
    elif change == "added token with a space":
        config["added_tokens"][1]["content"] = "<|im start|>"
    elif change == "normalized added token":
        config["added_tokens"][1]["normalized"] = True
    elif change == "dropout":
        config["model"]["dropout"] = 0.1
    elif change == "unigram":
        config["model"]["type"] = "Unigram"
    return config


@pytest.mark.parametrize("change", ["normalizer", "prefix space", "no regex", "other pre-tokenizer",
                                    "lstrip", "added token with a space", "normalized added token",
                                    "dropout", "unigram"])
def test_a_tokenizer_the_split_does_not_reproduce_is_left_to_the_library(change: str) -> None:
    assert piece_tokenizer_from(load_tokenizer(SMOLLM2), unsupported(change)) is None


@pytest.mark.parametrize("path", TOKENIZERS)
def test_the_configuration_read_from_a_loaded_tokenizer_is_its_files(path: str) -> None:
    read = configuration_of(load_tokenizer(path))
    written = config_of(path)
    flags = ("content", "lstrip", "rstrip", "single_word", "normalized")
    assert read["normalizer"] == written["normalizer"]
    assert read["pre_tokenizer"] == written["pre_tokenizer"]
    added = [{flag: token[flag] for flag in flags} for token in written["added_tokens"]]
    assert read["added_tokens"] == added
    assert read["model"] == {"type": written["model"]["type"], "dropout": written["model"]["dropout"]}


def test_the_shipped_tokenizers_qualify_with_their_own_digit_rules() -> None:
    assert fresh(TINY_CHAT).pieces("In 2024") == ["In", " 2024"]
    assert fresh(SMOLLM2).pieces("In 2024") == ["In", " ", "2", "0", "2", "4"]


def test_added_tokens_that_overlap_are_matched_longest_first_as_the_library_does() -> None:
    tokenizer = Tokenizer.from_str(load_tokenizer(TINY_CHAT).to_str())
    tokenizer.add_special_tokens(["<|us", "<|user|>!", "er|"])
    pieces = piece_tokenizer_from(tokenizer, json.loads(tokenizer.to_str()))
    assert pieces is not None
    for text in ["a<|user|>!b", "<|user|>", "<|user|>!!", "x<|usc<|us", "er|<|user|>!er|"]:
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text
