"""Tokenizers by path, loaded once per process.

`models.tokenizer` holds a tokenizer.json path relative to the `sluice.models` package (its
data files ship in the wheel; absolute paths are used as they are). Loading parses the whole
vocabulary, so each file is loaded once and shared; `tokenizers.Tokenizer.encode` is
thread-safe and holds no per-call state.

A long prompt is encoded in a worker thread through `encode_batch`, the call that releases the
GIL (`encode` holds it: a 1 MiB prompt stalled the event loop ~0.7 s, in a thread as inline,
against ~30 ms through `encode_batch`), so one caller's big prompt does not stall every other
call on the gateway. The size of a prompt is bounded at the RPC edge ([admission].max_input_bytes).
"""

from __future__ import annotations

import asyncio
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


# Below this many characters encoding takes well under 5 ms inline: cheaper than a thread hop.
OFF_LOOP_MIN_CHARS = 8_192


def _encode_releasing_gil(path: str, text: str) -> list[int]:
    return list(load_tokenizer(path).encode_batch([text], add_special_tokens=False)[0].ids)


async def encode_off_loop(path: str, text: str) -> list[int]:
    """`encode`, in a worker thread for long texts so the event loop keeps serving."""
    if len(text) < OFF_LOOP_MIN_CHARS:
        return encode(path, text)
    return await asyncio.to_thread(_encode_releasing_gil, path, text)
