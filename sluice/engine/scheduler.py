"""Inflight-batching scheduler: who is admitted, who is paused, who runs this step.

Two stages, as in TensorRT-LLM's batch manager:

1. Capacity (which requests hold KV). Requests are admitted FCFS from the
   waiting queue — paused ones first — while fewer than `max_num_seqs` run and
   the KV pool allows. Admission allocates the blocks of the whole context at
   once (cached prefix blocks are taken by reference), as TensorRT-LLM's
   addSequence does.
   - guaranteed_no_evict: a request is admitted only if the blocks it needs to
     reach prompt + request_output_len fit in the free pool after every running
     request's own remaining need is set aside. Nothing is ever paused, and the
     pool is never over-committed.
   - max_utilization: a request is admitted if its context blocks fit now.
     When the running requests' next tokens need more blocks than are free, the
     most recently admitted request is paused: its computed blocks are
     registered for reuse and released, and it waits at the head of the queue
     to recompute its context (prompt + tokens streamed so far) later.
   The queue head blocks those behind it: no skipping ahead (FCFS).
   A prefix found in the host tier (kv_cache.HostPool) counts as cached: its
   blocks are fresh blocks (they need room like any other) filled by a copy
   from host memory, which the executor prices in the admitting step, and
   their tokens are never prefilled again.

2. Micro-batch (what runs this step under `max_num_tokens`). Every request in
   generation decodes one token first, so a long prompt never starves decodes;
   context requests then take chunks of the remaining budget in admission
   order. A chunk that is not the last of its context is a multiple of the
   block size (TensorRT-LLM's chunk unit); without chunked context a context
   runs only when it fits whole.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sluice.engine.kv_cache import BlockPool
from sluice.engine.sequence import SequenceState
from sluice.engine.types import EngineConfig


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached start of a context, by tier."""

    blocks: list[int]                         # GPU blocks, taken by reference
    host_hashes: list[int]                    # the host-tier run after them, copied into fresh blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.host_hashes)


@dataclass(slots=True)
class ScheduledBatch:
    decodes: list[SequenceState]
    chunks: list[tuple[SequenceState, int]]   # (context request, tokens to compute this step)
    num_paused: int
    onboarded_blocks: int = 0                 # host-tier blocks copied back before this step runs

    def samplers(self) -> list[SequenceState]:
        """Sequences that sample an id this step: every decode, then each chunk that ends its context."""
        return self.decodes + [seq for seq, chunk in self.chunks
                               if seq.num_computed + chunk == seq.context_len]


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []      # admission order; the last is paused first
        self.num_paused_waiting = 0

    # --- admission cost ---------------------------------------------------------------------

    def reserve_blocks(self, seq: SequenceState) -> int:
        """Blocks `seq` may hold by the end: its whole prompt plus request_output_len."""
        return _blocks_for(seq.prompt_len + seq.cap, self.block_size)

    def prefix_hits(self, seq: SequenceState) -> PrefixHit:
        """Cached blocks covering the start of `seq`'s context, in either tier. At least one context
        token is always computed (it produces the next sample), so a fully cached context gives
        back its last block."""
        if not self.config.enable_prefix_reuse:
            return PrefixHit([], [])
        usable = (seq.context_len - 1) // self.block_size
        hashes = seq.hashes_upto(seq.context_len, self.block_size, self.config.tokens)[:usable]
        gpu, host = self.pool.lookup_tiers(hashes)
        return PrefixHit(gpu, host)

    def _free_blocks_taken(self, hits: list[int]) -> int:
        return sum(1 for block_id in hits if self.pool.is_free(block_id))

    def _outstanding_reservation(self) -> int:
        return sum(self.reserve_blocks(seq) - len(seq.block_ids) for seq in self.running)

    def can_admit(self, seq: SequenceState, decode_need: int) -> PrefixHit | None:
        """The prefix hits to take when `seq` fits now, else None. Pure: changes nothing. Host-tier
        hits need fresh blocks, so only GPU hits lower the need."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        hits = self.prefix_hits(seq)
        gpu = len(hits.blocks)
        taken = self._free_blocks_taken(hits.blocks)
        if self.config.policy == "guaranteed_no_evict":
            need = self.reserve_blocks(seq) - gpu + taken
            available = self.pool.num_free - self._outstanding_reservation()
        else:
            need = _blocks_for(seq.context_len, self.block_size) - gpu + taken
            available = self.pool.num_free - decode_need
        return hits if need <= available else None

    def admit(self, seq: SequenceState, hits: PrefixHit) -> None:
        pool = self.pool
        pool.touch(hits.blocks)
        fresh = pool.onboard(hits.host_hashes,
                             _blocks_for(seq.context_len, self.block_size) - len(hits.blocks))
        cached = hits.num_blocks
        seq.block_ids = hits.blocks + fresh
        seq.num_computed = cached * self.block_size
        seq.num_registered = cached
        seq.in_context = True
        full_blocks = (seq.context_len - 1) // self.block_size if self.config.enable_prefix_reuse else 0
        pool.count_hits(cached, max(0, full_blocks - cached))
        if not seq.admitted:
            seq.admitted = True
            seq.reused_blocks = cached
            seq.num_cached_tokens = seq.num_computed
        self.running.append(seq)

    # --- pausing (max_utilization) ----------------------------------------------------------

    def decode_block_need(self) -> int:
        """New blocks the generation requests need for this step's token."""
        block_size = self.block_size
        return sum(1 for seq in self.running
                   if not seq.in_context and seq.num_computed + 1 > len(seq.block_ids) * block_size)

    def register_computed(self, seq: SequenceState) -> None:
        """Make `seq`'s computed full blocks findable by the next request with the same prefix."""
        if not self.config.enable_prefix_reuse:
            return
        full = seq.num_computed // self.block_size
        if full > seq.num_registered:
            hashes = seq.hashes_upto(full * self.block_size, self.block_size, self.config.tokens)
            self.pool.register(seq.block_ids[seq.num_registered:full], hashes[seq.num_registered:full])
            seq.num_registered = full

    def release(self, seq: SequenceState) -> None:
        """Register `seq`'s computed full blocks for reuse, then drop its references."""
        self.register_computed(seq)
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.num_registered = 0

    def pause(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.context_len = seq.prompt_len + seq.num_streamed
        seq.in_context = True
        seq.times_paused += 1
        self.waiting.appendleft(seq)
        self.num_paused_waiting += 1

    def _make_room_for_decodes(self) -> tuple[int, int]:
        """Pause the newest requests until this step's decode blocks fit; (paused, need)."""
        paused = 0
        need = self.decode_block_need()
        while need > self.pool.num_free and len(self.running) > 1:
            self.pause(self.running[-1])
            paused += 1
            need = self.decode_block_need()
        assert need <= self.pool.num_free, "a single request outgrew the KV pool"
        return paused, need

    # --- the step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        paused, decode_need = (self._make_room_for_decodes() if self.config.policy == "max_utilization"
                               else (0, 0))
        # A step that had to pause admits nobody: the pool is short, and the request just paused
        # would otherwise bounce straight back in.
        onboarded = 0
        while self.waiting and not paused:
            head = self.waiting[0]
            hits = self.can_admit(head, decode_need)
            if hits is None:
                break
            self.waiting.popleft()
            if head.admitted:              # only a paused request comes back to the queue
                self.num_paused_waiting -= 1
            self.admit(head, hits)
            onboarded += len(hits.host_hashes)
        batch = self._micro_batch(paused)
        batch.onboarded_blocks = onboarded
        return batch

    def _micro_batch(self, paused: int) -> ScheduledBatch:
        budget = self.config.max_num_tokens
        block_size = self.block_size
        decodes: list[SequenceState] = []
        contexts: list[SequenceState] = []
        for seq in self.running:
            (contexts if seq.in_context else decodes).append(seq)
        for seq in decodes:
            if seq.num_computed + 1 > len(seq.block_ids) * block_size:
                block = self.pool.allocate(1)
                assert block is not None, "the capacity stage left a block for every decode"
                seq.block_ids.extend(block)
        budget -= len(decodes)
        chunks: list[tuple[SequenceState, int]] = []
        for seq in contexts:
            remaining = seq.context_len - seq.num_computed
            chunk = min(remaining, budget)
            if chunk < remaining:
                if not self.config.enable_chunked_context:
                    break
                chunk -= chunk % block_size
            if chunk <= 0:
                break
            chunks.append((seq, chunk))
            budget -= chunk
        return ScheduledBatch(decodes=decodes, chunks=chunks, num_paused=paused)
