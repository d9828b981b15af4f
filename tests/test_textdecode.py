"""The DELTA text decoder: pieces concatenate to the full decode, with bounded work per delta."""

import random

from sluice.services.routing.textdecode import WINDOW_TOKENS, IncrementalDecoder, load_tokenizer

TOKENIZER = "tiny-chat/tokenizer.json"
TEXT = ("Sluice streams tokens — résumé, naïve café, 東京, emoji 🚰🌊 and plain ASCII words, "
        "so that multi-byte characters split across tokens. ") * 6


def pieces_of(token_ids: list[int], chunk_sizes: list[int]) -> list[str]:
    decoder = IncrementalDecoder(load_tokenizer(TOKENIZER))
    pieces, start = [], 0
    for size in chunk_sizes:
        pieces.append(decoder.push(token_ids[start:start + size]))
        start += size
    return pieces


def test_pieces_pushed_one_token_at_a_time_concatenate_to_the_full_decode():
    tokenizer = load_tokenizer(TOKENIZER)
    ids = tokenizer.encode(TEXT).ids
    assert "".join(pieces_of(ids, [1] * len(ids))) == tokenizer.decode(ids)


def test_pieces_of_random_sizes_concatenate_to_the_full_decode():
    tokenizer = load_tokenizer(TOKENIZER)
    ids = tokenizer.encode(TEXT).ids
    rng = random.Random(7)
    for _ in range(20):
        sizes, left = [], len(ids)
        while left:
            sizes.append(min(left, rng.randint(1, 9)))
            left -= sizes[-1]
        assert "".join(pieces_of(ids, sizes)) == tokenizer.decode(ids)


def test_a_split_multibyte_character_is_held_back_until_it_is_complete():
    tokenizer = load_tokenizer(TOKENIZER)
    ids = tokenizer.encode("🌊").ids
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test to mean anything"
    pieces = pieces_of(ids, [1] * len(ids))
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🌊"


class CountingTokenizer:
    """Decodes like the real tokenizer and records how many tokens each call decoded."""

    def __init__(self) -> None:
        self.real = load_tokenizer(TOKENIZER)
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return self.real.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_delta_decodes_a_short_window_not_the_whole_run():
    counting = CountingTokenizer()
    ids = counting.real.encode(TEXT * 4).ids
    decoder = IncrementalDecoder(counting)  # type: ignore[arg-type]
    for token in ids:
        decoder.push([token])
    assert len(ids) > 1000
    # The window holds at most WINDOW_TOKENS tokens, and the tokens of a character not yet whole (a
    # character is at most 4 bytes: at most 3 byte-level tokens held back).
    assert max(counting.decoded_lengths) <= WINDOW_TOKENS + 3


def test_most_deltas_cost_one_decode_the_window_is_decoded_again_only_when_it_moves_on():
    counting = CountingTokenizer()
    ids = counting.real.encode(TEXT * 4).ids
    decoder = IncrementalDecoder(counting)  # type: ignore[arg-type]
    for token in ids:
        decoder.push([token])
    # A push decodes its window; the one after the window moved on also decodes the window's
    # emitted part: 1 + 1/WINDOW_TOKENS decodes per single-token push, plus the held-back ones.
    assert len(counting.decoded_lengths) / len(ids) < 1 + 2 / WINDOW_TOKENS
