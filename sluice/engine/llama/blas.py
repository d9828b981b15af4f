"""How many threads numpy's OpenBLAS may use, set at run time.

OPENBLAS_NUM_THREADS only works before numpy is imported, and a replica host imports numpy
long before it knows its executor. numpy's wheel links its own OpenBLAS (64-bit ints, symbols
suffixed `64_`); `dlsym` on the extension module's handle finds it among its dependencies.
"""

from __future__ import annotations

import ctypes

import numpy.core._multiarray_umath as umath

SETTERS = ("openblas_set_num_threads64_", "openblas_set_num_threads")


def limit_threads(count: int) -> bool:
    """Ask OpenBLAS for `count` threads; False when numpy was built against another BLAS."""
    library = ctypes.CDLL(umath.__file__)
    for name in SETTERS:
        setter = getattr(library, name, None)
        if setter is not None:
            setter(count)
            return True
    return False
