"""A tiny C helper for the one sequential loop of the data pipeline (the blending schedule),
compiled on first use with the system C compiler and loaded with ctypes.

Without a compiler (or with ``HF_MEGATRON_NO_COMPILE=1``) ``load()`` returns None and callers use
their pure-Python loop, which gives the same arrays, only slower (~1 us per sample).
``-ffp-contract=off`` keeps ``w * t - c`` as two roundings, as megatron-core's helper computes it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile

import numpy as np

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* Largest-deficit schedule: step t picks argmax_i (w_i * max(t,1) - taken_i) over datasets still
   in the race (first index wins ties); with capacity != 0, dataset i leaves once it gave
   capacity[i] samples. */
void blend_schedule(const double *weights, int32_t count, int64_t size, const int64_t *capacity,
                    int16_t *chosen, int64_t *served, int64_t *taken) {
    for (int32_t i = 0; i < count; ++i) taken[i] = 0;
    for (int64_t t = 0; t < size; ++t) {
        double scale = t > 1 ? (double)t : 1.0;
        int32_t best = -1;
        double best_error = -INFINITY;
        for (int32_t i = 0; i < count; ++i) {
            if (capacity && taken[i] >= capacity[i]) continue;
            double error = weights[i] * scale - (double)taken[i];
            if (error > best_error) { best = i; best_error = error; }
        }
        chosen[t] = (int16_t)best;
        served[t] = taken[best];
        taken[best] += 1;
    }
}
"""

_library = None
_tried = False


def _cache_dir() -> str:
    root = os.environ.get("HF_MEGATRON_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_megatron")
    return os.path.join(root, "data_helpers")


def load():
    """The compiled library, or None when it cannot be built here."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    if os.environ.get("HF_MEGATRON_NO_COMPILE") == "1":
        return None
    digest = hashlib.sha1(SOURCE.encode()).hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"blend_{digest}.so")
    try:
        if not os.path.isfile(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as work:
                source = os.path.join(work, "blend.c")
                with open(source, "w") as out:
                    out.write(SOURCE)
                built = os.path.join(work, "blend.so")
                subprocess.run([os.environ.get("CC", "cc"), "-O2", "-ffp-contract=off", "-shared", "-fPIC",
                                "-o", built, source], check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent ranks never load a partial file
        library = ctypes.CDLL(target)
        library.blend_schedule.restype = None
        library.blend_schedule.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _library = library
    except (OSError, subprocess.SubprocessError):
        _library = None
    return _library


def blend_schedule(weights: list[float], size: int, capacity: list[int] | None):
    """(chosen int16[size], served int64[size]) from the C helper, or None if unavailable."""
    library = load()
    if library is None:
        return None
    w = np.ascontiguousarray(weights, dtype=np.float64)
    cap = None if capacity is None else np.ascontiguousarray(capacity, dtype=np.int64)
    chosen = np.empty(size, dtype=np.int16)
    served = np.empty(size, dtype=np.int64)
    taken = np.zeros(max(len(w), 1), dtype=np.int64)
    library.blend_schedule(w.ctypes.data, len(w), size, None if cap is None else cap.ctypes.data,
                           chosen.ctypes.data, served.ctypes.data, taken.ctypes.data)
    return chosen, served
