"""The committed tiny-chat tokenizer: fixed special-token ids and lossless round trips."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer

TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "sluice" / "models" / "tiny-chat" / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_PATH))


def test_the_vocabulary_has_4096_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size() == 4096


@pytest.mark.parametrize(
    ("token", "token_id"),
    [("<|endoftext|>", 0), ("<|pad|>", 1), ("<|system|>", 2), ("<|user|>", 3), ("<|assistant|>", 4)],
)
def test_special_tokens_have_the_documented_ids(tokenizer: Tokenizer, token: str, token_id: int) -> None:
    assert tokenizer.token_to_id(token) == token_id


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  two leading spaces,\ttabs and\nnewlines\n",
        "Crème brûlée — 東京 🚀 Привет",
        "",
    ],
)
def test_decoding_the_encoding_gives_back_the_text(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_a_literal_special_token_in_text_encodes_to_its_id(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|user|>hi<|endoftext|>").ids
    assert (ids[0], ids[-1]) == (3, 0)
