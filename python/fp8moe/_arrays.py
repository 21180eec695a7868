"""numpy arrays to and from fp8moe._core without copies.

numpy can export ml_dtypes arrays (bfloat16, float8_*) through neither DLPack
nor the buffer protocol, so they cross as a view of the unsigned integer type
of the same width plus the dtype's name; results come back the same way and are
viewed as their ml_dtypes type. A view is not a copy: the C++ code reads and
writes the array's own memory.
"""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

# ml_dtypes types by fp8moe's name for them, and the storage type numpy uses.
ML_DTYPES = {
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
_STORAGE = {dt: np.dtype(f"uint{8 * dt.itemsize}") for dt in ML_DTYPES.values()}


def arg(x: Any) -> tuple[np.ndarray, str]:
    """(array for _core, dtype name). Anything np.asarray accepts is taken; a
    numpy (or CPU jax) array is used in place. A Python list or tuple has no
    dtype of its own: its floats become float32 and its integers int32, the
    types the library takes (np.asarray would make float64 and int64, which
    every function refuses)."""
    if isinstance(x, (list, tuple)):
        a = np.asarray(x)
        if a.dtype == np.float64:
            a = a.astype(np.float32)
        elif a.dtype == np.int64:
            a = a.astype(np.int32)
    else:
        a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype.kind in "OUSVMm" and a.dtype not in _STORAGE:  # objects, strings, records, dates
        raise ValueError(f"an array of dtype {a.dtype} is not numeric data; give float32, "
                         "bfloat16, float8_*, int8 or int32 arrays")
    if not a.dtype.isnative:
        raise ValueError(f"an array of non-native byte order ({a.dtype.str}) cannot be read in place; "
                         "convert it with x.astype(x.dtype.newbyteorder('='))")
    storage = _STORAGE.get(a.dtype)
    if storage is not None:
        return a.view(storage), a.dtype.name
    return a, a.dtype.name


def opt(x: Any) -> tuple[np.ndarray | None, str | None]:
    """arg(x), or (None, None) for None."""
    return (None, None) if x is None else arg(x)


def out(pair: tuple[np.ndarray, str]) -> np.ndarray:
    """A _core result (array, fp8moe dtype name) as a numpy array of that dtype."""
    a, name = pair
    dt = ML_DTYPES.get(name)
    return a if dt is None else a.view(dt)
