"""CPU of tokenizing a prompt: the library's whole-text call against remembered words and pieces.

`python -m bench.bench_tokenize [--prompts 1000] [--chars 6300]`

For each shipped tokenizer, --prompts different prompts of --chars characters (~2,000 tiny-chat
tokens at 6,300), encoded once each in order by both paths into the ids as admission stores them
(ledger/token_ids.py: the library's ids packed; services/token_pieces.py's encode_packed, starting
with empty caches), alternating path by path so that the box's drift falls on both:
  corpus   consecutive slices of sluice/models/corpus.txt, words one space apart (varied English,
           ~10% of slices with a non-ASCII character; each slice read once: a cache that keeps
           meeting new words; as many as the corpus holds, ~100 at 6,300 characters); the first
           tenth and the rest are reported apart
  slices   random slices of the same text (what `make bench-platform-seed` sends: each Submit its own
           slice; a slice's first and last words are cut at random, so most prompts bring a piece
           never seen); the first tenth and the rest are reported apart
  repeat   the bench's prompt (bench_platform.prompt_of), the same text every time
  noise    12-character random hex words (no piece repeats: the worst case for a cache)
Prints the median process-CPU microseconds per prompt of each path and their ratio, and the words
and pieces remembered at the end. Every prompt's ids are checked against the library's; never fails
on timing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import time
from collections.abc import Callable

from sluice.ledger import token_ids
from sluice.services import tokenization
from sluice.services.token_pieces import PieceTokenizer

from bench.bench_platform import corpus_of, prompt_of
from sluice.models import load_tokenizer

TOKENIZERS = ["tiny-chat/tokenizer.json", "smollm2-135m-instruct/tokenizer.json"]


def cpu_us(encode: Callable[[str], bytes], text: str) -> tuple[float, bytes]:
    start = time.process_time()
    packed = encode(text)
    return (time.process_time() - start) * 1e6, packed


def texts(kind: str, prompts: int, chars: int) -> list[str]:
    if kind in ("corpus", "slices"):
        corpus = corpus_of("corpus")
        if kind == "corpus":
            return [corpus[i * chars:(i + 1) * chars] for i in range(min(prompts, len(corpus) // chars))]
        starts = random.Random(17)
        return [corpus[start:start + chars] for start in
                (starts.randrange(len(corpus) - chars) for _ in range(prompts))]
    if kind == "repeat":
        return [prompt_of(round(chars / 3.15))] * prompts
    rng = random.Random(5)
    return [" ".join("".join(rng.choices(string.hexdigits, k=12)) for _ in range(chars // 13))
            for _ in range(prompts)]


def measure(path: str, kind: str, prompts: int, chars: int) -> str:
    tokenizer = load_tokenizer(path)
    tokenization.load_piece_tokenizer.cache_clear()
    pieces: PieceTokenizer | None = tokenization.load_piece_tokenizer(path)
    assert pieces is not None
    whole_us: list[float] = []
    pieces_us: list[float] = []
    tokens: list[int] = []
    def library(text: str) -> bytes:
        return token_ids.pack(tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids)

    for text in texts(kind, prompts, chars):
        whole, expected = cpu_us(library, text)
        piecewise, packed = cpu_us(pieces.encode_packed, text)
        assert packed == expected, f"{path} {kind}: pieces differ from the library"
        whole_us.append(whole)
        pieces_us.append(piecewise)
        tokens.append(token_ids.count(packed))
    count = len(tokens)
    lines = []
    spans = [("", slice(None))]
    if kind in ("corpus", "slices"):
        spans = [(" first tenth", slice(0, count // 10)), (" the rest", slice(count // 10, None))]
    for label, span in spans:
        w, p = statistics.median(whole_us[span]), statistics.median(pieces_us[span])
        lines.append(f"  {kind}{label}: library {w:.0f} us, pieces {p:.0f} us per prompt (x{w / p:.1f} less"
                     f" CPU; {len(tokens[span])} prompts of ~{statistics.median(tokens):.0f} tokens)")
    return "\n".join(lines) + f"; {pieces.cached_words()} words, {pieces.cached_pieces()} pieces remembered"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--chars", type=int, default=6_300)
    args = parser.parse_args()
    print(f"bench-tokenize: {args.prompts} prompts of {args.chars} characters per kind, process CPU per"
          " prompt (median), both paths alternated prompt by prompt")
    for path in TOKENIZERS:
        print(path)
        for kind in ["corpus", "slices", "repeat", "noise"]:
            print(measure(path, kind, args.prompts, args.chars))


if __name__ == "__main__":
    main()
