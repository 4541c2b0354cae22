"""Megatron's blending indices: which dataset, and which of its samples, feeds blended sample t.

Weights ``w`` are normalised to sum to 1.  Sample ``t`` goes to the dataset furthest behind its
share, ``argmax_i (w_i * max(t, 1) - c_i(t))`` with ``c_i(t)`` the samples dataset ``i`` has given
so far (first index wins ties); it serves its sample number ``c_i(t)``.  This is a deterministic
largest-deficit schedule: after ``t`` samples every ``|c_i - w_i t| < 1``.

The exhaustive variant (no size given, integer weights = dataset sizes) runs the same rule with
``w_i = size_i / sum(size)`` but drops a dataset from the argmax once it is spent, so each dataset
``i`` appears exactly ``size_i`` times.

The arithmetic is float64 in the same order as megatron-core's helper, so the arrays are equal
element for element.  It is a sequential recurrence: it runs in a tiny C helper compiled on
first use (compiled.py), or, without a C compiler, as the Python loop below (~1 us per sample).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import DataError
from . import compiled


def normalize(weights) -> list[float]:
    """w / sum(w) in float64 (the same rounding as megatron-core's ``normalize``)."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def _largest_deficit(weights: list[float], size: int, capacity: list[int] | None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The schedule loop; with ``capacity`` a dataset leaves the race once it gave that many.
    Runs in the compiled helper when one can be built (compiled.py), else in Python."""
    fast = compiled.blend_schedule(weights, size, capacity)
    if fast is not None:
        return fast
    taken = [0] * len(weights)
    candidates = [i for i in range(len(weights)) if capacity is None or capacity[i] > 0]
    chosen, served = [0] * size, [0] * size
    for t in range(size):
        scale = float(t) if t > 1 else 1.0
        best, best_error = -1, -math.inf
        for i in candidates:
            error = weights[i] * scale - taken[i]
            if error > best_error:
                best, best_error = i, error
        chosen[t] = best
        served[t] = taken[best]
        taken[best] += 1
        if capacity is not None and taken[best] == capacity[best]:
            candidates.remove(best)
    return np.asarray(chosen, dtype=np.int16), np.asarray(served, dtype=np.int64)


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16[size], dataset_sample_index int64[size]) for normalised ``weights``."""
    weights = [float(w) for w in weights]
    if len(weights) >= 32767:
        raise DataError(f"at most 32766 datasets can be blended, got {len(weights)}")
    return _largest_deficit(weights, int(size), None)


def build_exhaustive_blending_indices(sizes) -> tuple[np.ndarray, np.ndarray]:
    """Every sample of every dataset exactly once, interleaved in proportion to ``sizes``."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    weights = [s / float(total) for s in sizes] if total else []
    return _largest_deficit(weights, total, sizes)
