"""The vocabulary every layer shares: tensor specs, dtypes, sizes, path containment (layer 0: imports nothing of
dsconv but errors).

Why one module: the reader, the writer, the families and every stage talk about the same things - a tensor's name,
safetensors dtype and shape, how many bytes that is, what torch/numpy/config.json call that dtype - and each kept its
own copy of the table until the copies disagreed. One table (`DTYPES`) answers all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsconv.errors import UserError


@dataclass(frozen=True)
class DType:
    """One safetensors dtype and its names elsewhere (None where that library has no such type)."""

    name: str  # safetensors spelling: "BF16"
    size: int  # bytes per element
    torch: str | None  # torch attribute and config.json `torch_dtype` spelling: "bfloat16"
    numpy: str | None  # numpy `dtype.str` without the byte order: "f2"
    floating: bool = False


_TABLE = (
    DType("BOOL", 1, "bool", "b1"), DType("U8", 1, "uint8", "u1"), DType("I8", 1, "int8", "i1"),
    DType("F8_E4M3", 1, "float8_e4m3fn", None, True), DType("F8_E5M2", 1, "float8_e5m2", None, True),
    DType("F8_E8M0", 1, None, None, True),
    DType("I16", 2, "int16", "i2"), DType("U16", 2, "uint16", "u2"), DType("F16", 2, "float16", "f2", True),
    DType("BF16", 2, "bfloat16", None, True),
    DType("I32", 4, "int32", "i4"), DType("U32", 4, "uint32", "u4"), DType("F32", 4, "float32", "f4", True),
    DType("I64", 8, "int64", "i8"), DType("U64", 8, "uint64", "u8"), DType("F64", 8, "float64", "f8", True),
)
#: safetensors dtype name -> its facts
DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
#: safetensors dtype name -> item size in bytes
DTYPE_SIZES: dict[str, int] = {d.name: d.size for d in _TABLE}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
#: the float dtypes a stage converts between (FP8 is dequantized, not cast)
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})

#: the `--dtype` choices of the export stages -> safetensors dtype
PRECISIONS: dict[str, str] = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}
#: config.json `torch_dtype` spellings (and the short ones people write) -> safetensors dtype
DTYPE_FROM_CONFIG: dict[str, str] = {
    **{DTYPES[st].torch: st for st in PRECISIONS.values()}, "float": "F32", "half": "F16", **PRECISIONS}

_NP_TO_ST = {d.numpy: d.name for d in _TABLE if d.numpy}
_TORCH_TO_ST: dict[Any, str] = {}


def torch_dtype(st_dtype: str):
    """The torch dtype of a safetensors dtype name (KeyError for one torch cannot hold)."""
    import torch

    attr = DTYPES[st_dtype].torch
    if attr is None:
        raise KeyError(st_dtype)
    return getattr(torch, attr)


def numpy_dtype(st_dtype: str):
    """The numpy dtype of a safetensors dtype name; BF16 is ml_dtypes' bfloat16 (KeyError for one numpy cannot
    hold). Why: the weight-only path reads tensors as numpy views and never loads torch (2 s of its start-up)."""
    import numpy as np

    if st_dtype == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    code = DTYPES[st_dtype].numpy
    if code is None:
        raise KeyError(st_dtype)
    return np.dtype("<" + code)


def precision_torch_dtype(precision: str):
    """The torch dtype of a `--dtype` choice (fp32, fp16, bf16)."""
    return torch_dtype(PRECISIONS[precision])


def config_dtype_name(precision: str) -> str:
    """config.json's `torch_dtype` spelling of a `--dtype` choice."""
    return DTYPES[PRECISIONS[precision]].torch or ""


def config_with_dtype(config: dict[str, Any], precision: str) -> dict[str, Any]:
    """A copy of config.json naming the `--dtype` choice as the model dtype, under the keys it has (transformers 5
    writes `dtype`, 4 `torch_dtype`; `dtype` where it has neither)."""
    import json

    new = json.loads(json.dumps(config))
    for k in [k for k in ("dtype", "torch_dtype") if k in new] or ["dtype"]:
        new[k] = config_dtype_name(precision)
    return new


def safetensors_dtype(t: Any) -> str:
    """safetensors dtype name of a torch tensor or numpy array, or of a torch dtype."""
    import numpy as np

    if isinstance(t, np.ndarray):
        return "BF16" if t.dtype.name == "bfloat16" else _NP_TO_ST[t.dtype.str[1:]]
    if not _TORCH_TO_ST:
        import torch

        _TORCH_TO_ST.update({getattr(torch, d.torch): d.name for d in _TABLE if d.torch})
    return _TORCH_TO_ST[getattr(t, "dtype", t)]


@dataclass(frozen=True)
class TensorSpec:
    """What the writer must know of a tensor before any data: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def parse_size(text: str | int) -> int:
    """'4GB', '500MB', '2GiB', '1000' -> bytes (HF's max_shard_size convention: GB = 10^9, GiB = 2^30)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for unit, factor in units.items():
        if s.endswith(unit):
            number = s[: -len(unit)]
            break
    else:
        number, factor = s, 1
    try:
        value = int(float(number) * factor)  # inf -> OverflowError, nan -> ValueError
    except (ValueError, OverflowError):
        raise UserError(f"cannot read size {text!r}", hint="write it like 4GB, 500MB or 2GiB") from None
    if value <= 0:
        raise UserError(f"size {text!r} must be positive")
    return value


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units): readable from a tiny test model to a 1.3 TB checkpoint."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return str(n)


def is_within(child: Path, parent: Path) -> bool:
    """Whether `child` resolves inside `parent` (symlinks and `..` followed): the guard of every path dsconv
    reads from an index or writes to."""
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False
