"""One request's mutable state inside the engine (never leaves the core).

Token accounting, the same for a fresh request and one resumed after a pause:

    known tokens   = prompt + streamed outputs                 (ids we can name)
    context_len    = known tokens when the context phase began (what must be in KV
                     before the next sample)
    num_computed   = tokens whose KV is in this sequence's blocks

The context phase computes KV up to `context_len` (in chunks) and its last chunk
samples one token; each generation step then computes the KV of the newest
token and samples the next, so in generation num_computed = known − 1 and the
step reads num_computed + 1 tokens of KV.

`total_samples` is how many tokens the "model" samples in all: the drawn
output length, plus one for the end_id step when the request stops short of
its cap (end_id is sampled but not streamed, as TensorRT-LLM does). A real
model's sampled ids can shorten both (`accept`): end_id ends before the id,
a stop sequence ends after it.
"""

from __future__ import annotations

from sluice.engine.kv_cache import block_hashes, salted_root
from sluice.engine.sampling import TokenSpace, tokens_between
from sluice.engine.types import EngineRequest, FinishReason


class SequenceState:
    __slots__ = (
        "request", "request_id", "prompt_len", "cap", "output_len", "total_samples",
        "num_sampled", "num_computed", "context_len", "in_context", "block_ids", "hashes",
        "num_registered", "admitted", "reused_blocks", "num_cached_tokens", "times_paused",
        "output_ids", "stop_reason",
    )

    def __init__(self, request: EngineRequest, output_len: int) -> None:
        self.request = request
        self.request_id = request.request_id
        self.prompt_len = len(request.prompt_token_ids)
        self.cap = request.max_output_tokens
        self.output_len = output_len
        self.total_samples = output_len + (1 if output_len < self.cap else 0)
        self.num_sampled = 0
        self.num_computed = 0
        self.context_len = self.prompt_len
        self.in_context = True
        self.block_ids: list[int] = []
        self.hashes: list[int] = []        # chained hashes of the known tokens' full blocks (lazy)
        self.num_registered = 0            # leading blocks already registered in the pool
        self.admitted = False
        self.reused_blocks = 0             # at first admission, reported per response
        self.num_cached_tokens = 0
        self.times_paused = 0
        self.output_ids: list[int] = []    # streamed ids, when the executor materialises them
        self.stop_reason: FinishReason | None = None   # set when a sampled id ended the request

    def accept(self, index: int, token: int) -> None:
        """Record sampled id `index` (< output_len); end_id or a completed stop sequence ends here."""
        request = self.request
        if token == request.end_id:
            self._end_at(index, index + 1, "end_id")
            return
        self.output_ids.append(token)
        for stop in request.stop_sequences:
            if stop and self.output_ids[-len(stop):] == list(stop):
                self._end_at(index + 1, index + 1, "stop_words")
                return

    def _end_at(self, output_len: int, total_samples: int, reason: FinishReason) -> None:
        self.output_len = output_len
        self.total_samples = total_samples
        self.stop_reason = reason

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Known tokens [start, stop): prompt, then materialised outputs."""
        prompt = self.request.prompt_token_ids
        if stop <= self.prompt_len:
            return list(prompt[start:stop])
        known = list(prompt[start:]) if start < self.prompt_len else []
        first_output = max(0, start - self.prompt_len)
        return known + self.output_ids[first_output:stop - self.prompt_len]

    @property
    def num_streamed(self) -> int:
        return min(self.num_sampled, self.output_len)

    def finish_reason(self) -> FinishReason:
        if self.stop_reason is not None:
            return self.stop_reason
        return "length" if self.output_len == self.cap else "end_id"

    def known_tokens(self, space: TokenSpace) -> list[int]:
        prompt = list(self.request.prompt_token_ids)
        streamed = self.num_streamed
        if len(self.output_ids) >= streamed:
            prompt.extend(self.output_ids[:streamed])
        elif streamed:
            # Counting mode: ids were never materialised; the seed's stream is what was "sampled".
            prompt.extend(tokens_between(space, self.request.seed, 0, streamed))
        return prompt

    def hashes_upto(self, num_tokens: int, block_size: int, space: TokenSpace) -> list[int]:
        """Chained hashes of the full blocks among the first `num_tokens` known tokens."""
        wanted = num_tokens // block_size
        have = len(self.hashes)
        if wanted > have:
            prompt = self.request.prompt_token_ids
            tokens = prompt if num_tokens <= self.prompt_len else self.known_tokens(space)
            parent = self.hashes[-1] if have else salted_root(self.request.cache_salt)
            self.hashes.extend(block_hashes(tokens[:wanted * block_size], block_size, parent,
                                            start=have * block_size))
        return self.hashes[:wanted]
