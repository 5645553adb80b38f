"""The storage dtypes: fp16, fp32 and bf16, by their config names, and what the engine asks of them.

bfloat16 on NumPy is ``ml_dtypes.bfloat16`` (the dtype JAX and TensorFlow hand to NumPy):
arrays of it cast to and from float32 with ``astype`` (round to nearest even), so the
NumPy references, the models and a user's own code treat it as any float dtype, and the
C and CUDA kernels read its 16 bits in place. It is imported on first use; where it
cannot be, asking for bf16 raises ConfigError naming the package to install.
"""
from typing import Optional

import numpy as np

from ..errors import ConfigError

NAMES = ("fp16", "fp32", "bf16")
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
INSTALL_HINT = "pip install ml_dtypes"


def bfloat16(required: bool = True) -> Optional[np.dtype]:
    """NumPy's bfloat16 dtype (ml_dtypes); None, or ConfigError when ``required``, where it is missing."""
    try:
        import ml_dtypes
    except ImportError:
        if required:
            raise ConfigError(f"dtype='bf16' needs the ml_dtypes package, which cannot be imported; {INSTALL_HINT}")
        return None
    return np.dtype(ml_dtypes.bfloat16)


def storage_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a config name (fp16, fp32, bf16)."""
    if name == "fp16":
        return F16
    if name == "fp32":
        return F32
    if name == "bf16":
        return bfloat16()
    raise ConfigError(f"dtype={name!r} is not allowed; use one of {', '.join(NAMES)}")


def itemsize(name: str) -> int:
    """Bytes per stored element, without importing ml_dtypes (the estimator runs without it)."""
    if name not in NAMES:
        raise ConfigError(f"dtype={name!r} is not allowed; use one of {', '.join(NAMES)}")
    return 4 if name == "fp32" else 2


def is_bf16(dtype) -> bool:
    """Whether ``dtype`` is bfloat16 (False where ml_dtypes is missing: nothing can be bfloat16 then)."""
    bf = bfloat16(required=False) if getattr(np.dtype(dtype), "name", "") == "bfloat16" else None
    return bf is not None and np.dtype(dtype) == bf


def is_float(dtype) -> bool:
    """A floating dtype the engine can store or read: NumPy's float kinds, or bfloat16."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False
    return np.issubdtype(dt, np.floating) or is_bf16(dt)


def finfo(dtype):
    """``np.finfo`` for NumPy's floats, ``ml_dtypes.finfo`` for bfloat16."""
    if is_bf16(dtype):
        import ml_dtypes
        return ml_dtypes.finfo(np.dtype(dtype))
    return np.finfo(dtype)


def name_of(dtype) -> str:
    """The config name of a storage dtype."""
    dt = np.dtype(dtype)
    if dt == F16:
        return "fp16"
    if dt == F32:
        return "fp32"
    if is_bf16(dt):
        return "bf16"
    raise ConfigError(f"dtype {dt} is not a storage dtype; use float16, float32 or bfloat16")
