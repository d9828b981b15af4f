"""The Llama forward in numpy over the engine's paged KV blocks.

One call runs one engine step: every decode (one token each) and every context
chunk (many tokens each) go through the layers as one [tokens, hidden] matrix,
so the weight matmuls are shared by the whole batch. Only attention is per
sequence:

    KV pool, per layer:  k[layer] : [num_blocks × block_size, kv_heads, head_dim]   (v alike)
    token at position p of a sequence with blocks (b0, b1, …) lives in slot
        blocks[p // block_size] × block_size + p % block_size

Each layer first writes this step's K/V into their slots, then attends by
gathering the slots of positions 0..p. A prefix block the block manager handed
out as a cache hit is therefore read, never recomputed: its K/V are what the
request that computed it wrote. Decodes are attended together (padded to the
longest context, masked); each context chunk is attended with a causal mask.

`reference_logits` runs the same layers over a whole token list without the
pool (full recompute): the tests hold the cached path to it.

Architecture (SmolLM2-135M: 30 layers, hidden 576, 9 heads over 3 KV heads,
SwiGLU 1536, RoPE base 100,000, RMSNorm, tied embeddings): pre-norm blocks
    h = x + Wo · attn(rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x));  x' = h + Wd · (silu(Wg·n(h)) ⊙ Wu·n(h))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from sluice.engine.llama.weights import LlamaConfig, LlamaWeights

F32 = NDArray[np.float32]
I64 = NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class SeqInput:
    """One sequence's part of a step."""

    token_ids: Sequence[int]     # tokens whose K/V this step computes (1 for a decode)
    start: int                   # position of token_ids[0]
    block_ids: Sequence[int]     # the sequence's blocks, covering start + len(token_ids) tokens
    wants_logits: bool           # the last token's logits are needed (it samples)


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    scale = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    normed: F32 = (x * scale * weight).astype(np.float32, copy=False)
    return normed


def silu(x: F32) -> F32:
    return (x / (1.0 + np.exp(-x))).astype(np.float32, copy=False)


class RopeTable:
    """cos/sin of position × inverse frequency, for llama.cpp's pairwise rotation: dims (2i, 2i+1)
    of each head turn by pos × base^(-2i/head_dim) (the GGUF's Q/K rows are permuted to match)."""

    def __init__(self, config: LlamaConfig) -> None:
        half = config.head_dim // 2
        inv_freq = config.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / config.head_dim)
        angles = np.arange(config.context_length, dtype=np.float64)[:, None] * inv_freq[None, :]
        self.cos = np.cos(angles).astype(np.float32)
        self.sin = np.sin(angles).astype(np.float32)

    def apply(self, x: F32, positions: I64) -> F32:
        """x: [tokens, heads, head_dim] rotated in place of a copy."""
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out


def softmax_lastdim(scores: F32) -> F32:
    scores = scores - scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def causal_attention(q: F32, k: F32, v: F32, q_positions: I64, groups: int) -> F32:
    """q: [n, heads, d] at `q_positions`; k, v: [ctx, kv_heads, d] at positions 0..ctx-1.
    Query i sees keys 0..q_positions[i]. Returns [n, heads × d]."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(n, kv_heads, groups, dim).transpose(1, 2, 0, 3)          # [kv, g, n, d]
    scores = qg @ k.transpose(1, 2, 0)[:, None] / np.float32(np.sqrt(dim))   # [kv, g, n, ctx]
    hidden = np.arange(k.shape[0])[None, :] > q_positions[:, None]           # [n, ctx]
    scores[..., hidden] = -np.inf
    out = softmax_lastdim(scores) @ v.transpose(1, 0, 2)[:, None]            # [kv, g, n, d]
    return out.transpose(2, 0, 1, 3).reshape(n, heads * dim)


def decode_attention(q: F32, k: F32, v: F32, lengths: I64, groups: int) -> F32:
    """Decodes together. q: [b, heads, d]; k, v: [b, L, kv_heads, d] padded to the longest;
    row i attends its first lengths[i] keys. Returns [b, heads × d]."""
    b, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, kv_heads, groups, dim)                                 # [b, kv, g, d]
    scores = qg @ k.transpose(0, 2, 3, 1) / np.float32(np.sqrt(dim))         # [b, kv, g, L]
    padding = np.arange(k.shape[1])[None, :] >= lengths[:, None]             # [b, L]
    scores[padding[:, None, None, :].repeat(kv_heads, 1).repeat(groups, 2)] = -np.inf
    out = softmax_lastdim(scores) @ v.transpose(0, 2, 1, 3)                  # [b, kv, g, d]
    return out.reshape(b, heads * dim)


class LlamaModel:
    def __init__(self, weights: LlamaWeights) -> None:
        self.weights = weights
        self.config = weights.config
        self.rope = RopeTable(weights.config)
        self.groups = self.config.num_heads // self.config.num_kv_heads
        self.block_size = 0
        self.k_pool: F32 = np.zeros((0,), np.float32)
        self.v_pool: F32 = np.zeros((0,), np.float32)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        # np.zeros maps untouched pages lazily: an idle pool costs address space, not memory.
        c = self.config
        shape = (c.num_layers, num_blocks * block_size, c.num_kv_heads, c.head_dim)
        self.block_size = block_size
        self.k_pool = np.zeros(shape, np.float32)
        self.v_pool = np.zeros(shape, np.float32)

    # --- the cached (paged) path --------------------------------------------------------------

    def forward(self, seqs: Sequence[SeqInput]) -> F32:
        """Run one step; logits [one row per seq with wants_logits, in order, vocab]."""
        c = self.config
        tokens = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64)
        positions = np.concatenate([np.arange(s.start, s.start + len(s.token_ids)) for s in seqs])
        slots = np.concatenate([self._slots(s.block_ids, s.start, s.start + len(s.token_ids)) for s in seqs])
        # Decodes (one token) are attended together; longer inputs one by one.
        decode_rows = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        offsets = np.cumsum([0] + [len(s.token_ids) for s in seqs])
        decode_tokens = offsets[decode_rows]
        lengths = np.array([seqs[i].start + 1 for i in decode_rows], dtype=np.int64)
        longest = int(lengths.max()) if decode_rows else 0
        decode_slots = np.zeros((len(decode_rows), longest), dtype=np.int64)
        for row, i in enumerate(decode_rows):
            decode_slots[row, :lengths[row]] = self._slots(seqs[i].block_ids, 0, int(lengths[row]))
        chunks = [(i, int(offsets[i]), self._slots(s.block_ids, 0, s.start + len(s.token_ids)))
                  for i, s in enumerate(seqs) if len(s.token_ids) > 1]

        x = np.asarray(self.weights.embedding[tokens], dtype=np.float32)
        for layer_index, _layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(x, layer_index, positions)
            k_pool, v_pool = self.k_pool[layer_index], self.v_pool[layer_index]
            k_pool[slots] = k
            v_pool[slots] = v
            attended = np.empty((len(tokens), c.hidden), dtype=np.float32)
            if decode_rows:
                attended[decode_tokens] = decode_attention(q[decode_tokens], k_pool[decode_slots],
                                                           v_pool[decode_slots], lengths, self.groups)
            for i, first, ctx_slots in chunks:
                rows = slice(first, first + len(seqs[i].token_ids))
                attended[rows] = causal_attention(q[rows], k_pool[ctx_slots], v_pool[ctx_slots],
                                                  positions[rows], self.groups)
            x = self._finish_layer(x, attended, layer_index)
        last_rows = [int(offsets[i + 1]) - 1 for i, s in enumerate(seqs) if s.wants_logits]
        return self._logits(x[last_rows])

    def _slots(self, block_ids: Sequence[int], start: int, stop: int) -> I64:
        positions = np.arange(start, stop)
        blocks = np.asarray(block_ids, dtype=np.int64)[positions // self.block_size]
        slots: I64 = blocks * self.block_size + positions % self.block_size
        return slots

    # --- the reference (no cache, full recompute) ---------------------------------------------

    def reference_logits(self, token_ids: Sequence[int]) -> F32:
        """Logits at every position of `token_ids`, recomputed from scratch without the KV pool."""
        positions = np.arange(len(token_ids))
        x = np.asarray(self.weights.embedding[np.asarray(token_ids)], dtype=np.float32)
        for layer_index in range(self.config.num_layers):
            q, k, v = self._qkv(x, layer_index, positions)
            attended = causal_attention(q, k, v, positions, self.groups)
            x = self._finish_layer(x, attended, layer_index)
        return self._logits(x)

    # --- shared layer math --------------------------------------------------------------------

    def _qkv(self, x: F32, layer_index: int, positions: I64) -> tuple[F32, F32, F32]:
        c = self.config
        layer = self.weights.layers[layer_index]
        qkv = rms_norm(x, layer.attn_norm, c.norm_eps) @ layer.wqkv.T
        kv_width = c.num_kv_heads * c.head_dim
        n = x.shape[0]
        q = qkv[:, :c.hidden].reshape(n, c.num_heads, c.head_dim)
        k = qkv[:, c.hidden:c.hidden + kv_width].reshape(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.hidden + kv_width:].reshape(n, c.num_kv_heads, c.head_dim)
        return self.rope.apply(q, positions), self.rope.apply(k, positions), np.ascontiguousarray(v)

    def _finish_layer(self, x: F32, attended: F32, layer_index: int) -> F32:
        c = self.config
        layer = self.weights.layers[layer_index]
        h = x + attended @ layer.wo.T
        gate_up = rms_norm(h, layer.ffn_norm, c.norm_eps) @ layer.w_gate_up.T
        result: F32 = h + (silu(gate_up[:, :c.ffn]) * gate_up[:, c.ffn:]) @ layer.w_down.T
        return result

    def _logits(self, x: F32) -> F32:
        normed = rms_norm(x, self.weights.output_norm, self.config.norm_eps)
        logits: F32 = normed @ self.weights.embedding.T
        return logits
