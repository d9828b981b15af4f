"""Tokenizers by path, loaded once per process.

`models.tokenizer` holds a tokenizer.json path relative to the `sluice.models` package (its
data files ship in the wheel; absolute paths are used as they are). Loading parses the whole
vocabulary, so each file is loaded once and shared; `tokenizers.Tokenizer.encode` is
thread-safe and holds no per-call state.

A mostly-ASCII prompt of a byte-level BPE tokenizer (both shipped models) is encoded from
remembered words and pieces (services/token_pieces.py: the same ids, 4-6x less CPU for natural
text; its non-ASCII runs through the library) inline up to PIECES_INLINE_MAX_CHARS. Any other prompt goes
through the library's `encode_batch_fast` (a batch of one): the same ids as `encode` without the
character offsets nobody here reads, 17-38% less CPU, and it releases the GIL. A long prompt is
encoded that way in a worker thread (`encode` holds the GIL: a 1 MiB prompt stalled the event loop
~0.7 s, in a thread as inline, against ~30 ms through the batch call), so one caller's big prompt
does not stall every other call on the gateway. The size of a prompt is bounded at the RPC edge
([admission].max_input_bytes).

A chat model ships `chat.json` beside its tokenizer.json (sluice/models/build_smollm2.py):
the input of a run is then one user turn, wrapped in the model's chat template before it is
counted, so admission bills and the replica computes exactly the ids the model is given.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass

from sluice.ledger import token_ids
from sluice.services.token_pieces import PieceTokenizer, configuration_of, piece_tokenizer_from

from sluice.models import load_tokenizer, resolve_tokenizer_path


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    system: str               # the default system turn's content
    turn: str                 # format string with {role} and {content}
    generation_prompt: str    # opens the assistant's turn

    def render(self, user_text: str) -> str:
        return (self.turn.format(role="system", content=self.system)
                + self.turn.format(role="user", content=user_text) + self.generation_prompt)


@functools.lru_cache(maxsize=32)
def load_chat_template(path: str) -> ChatTemplate | None:
    """The chat template beside the tokenizer at `path`; None for a plain completion model."""
    chat = resolve_tokenizer_path(path).with_name("chat.json")
    if not chat.exists():
        return None
    fields = json.loads(chat.read_text())
    return ChatTemplate(system=fields["system"], turn=fields["turn"],
                        generation_prompt=fields["generation_prompt"])


def model_input(path: str, text: str) -> str:
    """`text` as the model sees it: one user turn when the model has a chat template."""
    template = load_chat_template(path)
    return template.render(text) if template is not None else text


def encode(path: str, text: str, wrap: bool = True) -> list[int]:
    """Token ids of `text` as the model sees it (model_input; no other special tokens added).
    `wrap=False`: `text` is already the whole prompt (a chat request rendered at the HTTP edge)."""
    return list(token_ids.unpack(encode_packed(path, text, wrap)))


def encode_packed(path: str, text: str, wrap: bool = True) -> bytes:
    """`encode`'s ids as runs.prompt_token_ids stores them (ledger/token_ids.py), what admission
    writes: the piece tokenizer builds them from remembered words already packed (no list of ints
    to build and pack again: ~0.1 ms of a 2,000-token Submit)."""
    prompt = model_input(path, text) if wrap else text
    pieces = _pieces_taking(path, prompt)
    if pieces is not None:
        return pieces.encode_packed(prompt)
    return token_ids.pack(load_tokenizer(path).encode_batch_fast([prompt], add_special_tokens=False)[0].ids)


@functools.lru_cache(maxsize=32)
def load_piece_tokenizer(path: str) -> PieceTokenizer | None:
    """The piece tokenizer of the tokenizer at `path`, or None where it would not be exact."""
    tokenizer = load_tokenizer(path)
    return piece_tokenizer_from(tokenizer, configuration_of(tokenizer))


# Below this many characters the library encodes well under 5 ms inline: cheaper than a thread hop.
OFF_LOOP_MIN_CHARS = 8_192
# Pieces take ~40-85 us per 1,000 characters of English on these machines (holding the GIL): up to
# 32 KiB (~10k tokens, ~1.5-3 ms) inline; a longer prompt goes to the library in a worker thread.
PIECES_INLINE_MAX_CHARS = 32_768


def _pieces_taking(path: str, text: str) -> PieceTokenizer | None:
    """The piece tokenizer that encodes `text` inline, or None: the library's path."""
    pieces = load_piece_tokenizer(path)
    if pieces is None or len(text) > PIECES_INLINE_MAX_CHARS or not pieces.takes(text):
        return None
    return pieces


async def encode_packed_off_loop(path: str, text: str, wrap: bool = True) -> bytes:
    """`encode_packed`, in a worker thread for long texts so the event loop keeps serving."""
    if len(text) < OFF_LOOP_MIN_CHARS or _pieces_taking(path, text) is not None:
        return encode_packed(path, text, wrap)
    return await asyncio.to_thread(encode_packed, path, text, wrap)
