"""Choosing the next id from a row of logits: greedy, temperature, top-p; seeded.

The random draw for output token `index` of a request seeded `seed` comes from
its own generator, numpy's PCG64 seeded with (seed, index). So a request's ids
depend on its seed and its logits only: not on which other requests share the
batch, nor on whether it was paused and recomputed in between.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

_MASK64 = (1 << 64) - 1


def sample(logits: NDArray[np.float32], temperature: float, top_p: float, seed: int, index: int) -> int:
    """Greedy when temperature <= 0; otherwise softmax(logits / temperature) restricted to the
    smallest set of most likely ids whose mass reaches top_p (the first id always stays)."""
    if temperature <= 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    ranked = probs[order]
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(ranked), top_p)) + 1    # ids up to the one crossing top_p
        ranked = ranked[:keep]
        order = order[:keep]
    draw = np.random.default_rng((seed & _MASK64, index)).random() * ranked.sum()
    chosen = min(int(np.searchsorted(np.cumsum(ranked), draw, side="right")), len(order) - 1)
    return int(order[chosen])
