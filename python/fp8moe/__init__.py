"""fp8moe: FP8 quantization-aware training of MoE grouped matmuls.

numpy bindings of the fp8moe C++ library (docs/python.md). Arrays are read in
place and results are new arrays the C++ code writes directly: nothing is
copied on the way in or out. Inputs must therefore be C-contiguous and aligned
(a ValueError says so otherwise). bfloat16 and the float8 formats are the
ml_dtypes types (ml_dtypes.bfloat16, float8_e4m3fn, float8_e4m3fnuz,
float8_e5m2, float8_e5m2fnuz). Bad input raises ValueError with the library's
own message (the one `fp8moe op` prints).

JAX primitives (XLA FFI, with gradients) are in fp8moe.jax.
"""
from __future__ import annotations

from typing import Any, Literal, NamedTuple, Optional, Sequence

import numpy as np

from . import _core
from ._arrays import ML_DTYPES, arg, opt, out
from ._flags_text import flag_list as _flags

__version__: str = _core.version()

__all__ = [
    "__version__", "info", "simd_target", "set_num_threads", "cast", "decode",
    "quantize", "dequantize", "gmm", "dlhs", "tgmm", "moe_config", "moe_forward",
    "moe_backward", "MoeForward", "MoeBackward", "ML_DTYPES",
]

Mode = Literal["f32", "bf16", "fake_qat", "native_fp8", "int8"]
Format = Literal["e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "bf16"]
QuantDType = Literal["e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "int8"]
Granularity = Literal["tensor", "row", "channel", "group_tile"]
ScaleArithmetic = Literal["exact_divide", "xla_reciprocal"]
Tiles = Optional[Sequence[Optional[int]]]


def info() -> str:
    """One line: the version, the SIMD target the kernels dispatch to, the
    OpenMP threads and whether the XLA FFI handlers (fp8moe.jax) were built."""
    ffi = "built" if _core.has_xla_ffi() else "not built"
    return (f"fp8moe {__version__}: SIMD target {_core.simd_target()}, "
            f"{_core.max_threads()} threads, XLA FFI handlers {ffi}")


def simd_target() -> str:
    """The SIMD target the kernels dispatch to on this CPU, e.g. 'AVX2'."""
    return _core.simd_target()


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    """v as an int in [lo, hi], else ValueError naming it (not nanobind's
    TypeError, which prints the binding's signature)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an integer; got {v!r}")
    if not lo <= int(v) <= hi:
        raise ValueError(f"{name}={int(v)} is out of range [{lo}, {hi}]")
    return int(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False; got {v!r}")
    return bool(v)


def _out_dtype(v: Any) -> str:
    """'float32' or 'bfloat16' from a name or a dtype (np.float32, ml_dtypes.bfloat16)."""
    try:
        name = v if isinstance(v, str) else np.dtype(v).name
    except TypeError:
        name = repr(v)
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"out_dtype must be float32 or bfloat16; got {v!r}")
    return name


def _not_here(fn: str, given: dict[str, Any], applies: bool, where: str) -> None:
    """A keyword that would be ignored (it applies only `where`) is an error,
    as `fp8moe op` makes it."""
    for key, value in given.items():
        if value is not None and not applies:
            raise ValueError(f"{fn}: {key} applies {where}; drop {key}={value!r}")


def set_num_threads(n: int) -> None:
    """OpenMP threads (1 to 1024) for calls made from the calling Python thread."""
    _core.set_num_threads(_int("set_num_threads: n", n, -(1 << 31), (1 << 31) - 1))


def cast(x: Any, format: Format, saturate: bool = False) -> np.ndarray:
    """x float32 [any shape] -> the same shape in `format`, rounded to nearest even.

    Returns an ml_dtypes array (float8_* or bfloat16). saturate=False is
    ml_dtypes' astype (values past max become NaN, or inf for e5m2);
    saturate=True clips to the format's max first (what quantization uses).
    """
    return out(_core.cast(*arg(x), format, _bool("cast: saturate", saturate)))


def decode(y: Any) -> np.ndarray:
    """y float8_* or bfloat16 [any shape] -> float32, exact."""
    return out(_core.decode(*arg(y)))


def quantize(x: Any, dtype: QuantDType = "e4m3fn", granularity: Granularity = "row", *,
             block_size: int = 0, calibration: str = "absmax",
             scale_arithmetic: ScaleArithmetic = "exact_divide",
             valid_rows: Optional[int] = None, group_sizes: Any = None,
             tile_m: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """x float32 -> (q codes, scale float32) (docs/numerics.md).

    granularity and shapes:
      tensor      x [any]           -> scale [1]
      row         x [R, C]          -> scale [R, ceil(C / block_size)] (block 0: [R, 1]);
                  rows >= valid_rows are tail rows: never read, q 0, scale 0
      channel     x [E, K, N]/[K, N] -> scale [E, N] ([1, N]): amax over K
      group_tile  x [M, C], group_sizes int32 [G] -> scale [tiles, C]: one scale
                  per (m-tile of tile_m rows of a group, channel); tile_m 0 is
                  one tile per group
    calibration: "absmax" or "fixed,a,b" (amax = max(|a|, |b|)).
    scale_arithmetic: "exact_divide" (true divisions, the default) or
      "xla_reciprocal" (what qwix computes under jax.jit: reciprocal
      multiplies, scales below 2^-63 floored at 1).
    q is an ml_dtypes float8 array, or int8 for dtype "int8".
    """
    q, s = _core.quantize(*arg(x), dtype, granularity, block_size, calibration,
                          scale_arithmetic, valid_rows, *opt(group_sizes), tile_m)
    return out(q), out(s)


def dequantize(q: Any, scale: Any, granularity: Granularity = "row", *,
               block_size: int = 0, group_sizes: Any = None,
               tile_m: int = 0) -> np.ndarray:
    """(q codes, scale float32) -> float32 f32(q) * scale, shapes as quantize."""
    return out(_core.dequantize(*arg(q), *arg(scale), granularity, block_size,
                                *opt(group_sizes), tile_m))


def _tiles(tiles: Tiles) -> tuple[Optional[int], Optional[int], Optional[int]]:
    if tiles is None:
        return None, None, None
    t = tuple(tiles)
    if len(t) != 3:
        raise ValueError(f"tiles must be (m, k, n) with None for the per-shape default; got {tiles!r}")
    return tuple(None if v is None else _int(f"tiles[{i}]", v, 1, 1 << 20)  # type: ignore[return-value]
                 for i, v in enumerate(t))


def gmm(lhs: Any, rhs: Any, group_sizes: Any, mode: Mode = "bf16", *,
        rhs_scale: Any = None, fp8_dtype: Optional[Literal["e4m3fn", "e4m3fnuz"]] = None,
        lhs_quant_block_size: int = 0, lhs_calibration: Optional[str] = None,
        scale_arithmetic: Optional[ScaleArithmetic] = None,
        epilogue: Optional[Literal["swiglu"]] = None,
        out_dtype: Literal["float32", "bfloat16"] = "float32", return_h: bool = False,
        tiles: Tiles = None, reference: bool = False):
    """Grouped matmul: out [M, N] = lhs [M, K] x rhs [E, K, N] per group.

    Rows are sorted by group: group g owns rows [off_g, off_g + group_sizes[g]).
    Rows past sum(group_sizes) are tail rows: never read, written as 0.
      group_sizes: int32 [E].
      mode f32:        lhs float32, rhs float32.
      mode bf16:       lhs bfloat16, rhs bfloat16.
      mode fake_qat:   lhs bfloat16, rhs fp8 codes + rhs_scale float32 [E, N]
                       (dequantized to a BF16 copy first).
      mode native_fp8: lhs float32/bfloat16 (quantized per row inside, with
                       lhs_quant_block_size 0/128/512, lhs_calibration and
                       scale_arithmetic), rhs codes of fp8_dtype + rhs_scale.
      mode int8:       lhs float32/bfloat16, rhs int8 codes + rhs_scale.
    epilogue "swiglu": rhs [E, K, 2F] = [gate | up], out [M, F] = silu(gate) * up;
    return_h also returns the pre-activation h [M, 2F] as (out, h).
    tiles: (m, k, n), None entries chosen per shape; any tile gives the same bits.
    reference: run the plain-loop twin instead of the fast kernel.
    fp8_dtype (default e4m3fn) applies to fake_qat and native_fp8 only;
    lhs_calibration (default absmax) and scale_arithmetic (default exact_divide)
    to native_fp8 and int8 only: set in another mode they are an error.
    """
    _not_here("gmm", {"fp8_dtype": fp8_dtype}, mode in ("fake_qat", "native_fp8"),
              "to modes fake_qat and native_fp8 only")
    _not_here("gmm", {"lhs_calibration": lhs_calibration, "scale_arithmetic": scale_arithmetic},
              mode in ("native_fp8", "int8"),
              "where lhs is quantized inside the call (modes native_fp8 and int8) only")
    o, h = _core.gmm(*arg(lhs), *arg(rhs), *opt(rhs_scale), *arg(group_sizes), mode,
                     fp8_dtype or "e4m3fn", _int("gmm: lhs_quant_block_size",
                                                 lhs_quant_block_size, -(1 << 62), 1 << 62),
                     lhs_calibration or "absmax", scale_arithmetic or "exact_divide",
                     epilogue or "none", _out_dtype(out_dtype), _bool("gmm: return_h", return_h),
                     *_tiles(tiles), _bool("gmm: reference", reference))
    return (out(o), out(h)) if return_h else out(o)


def dlhs(dout: Any, rhs: Any, group_sizes: Any, mode: Mode = "bf16", *,
         rhs_scale: Any = None, h: Any = None, fp8_dtype: Optional[str] = None,
         epilogue: Optional[Literal["dswiglu"]] = None,
         out_dtype: Literal["float32", "bfloat16"] = "float32", tiles: Tiles = None,
         reference: bool = False) -> np.ndarray:
    """Activation gradient: dlhs [M, K] = dout [M, N] x rhs[g]^T per group.

      mode f32:      dout float32; rhs float32, or fp8 codes + rhs_scale used as
                     f32(q) * s.
      mode bf16:     dout bfloat16; rhs bfloat16, or fp8 codes + rhs_scale dequantized
                     tile by tile inside the kernel (no copy; bit-identical to fake_qat).
      mode fake_qat: dout bfloat16; rhs fp8 codes + rhs_scale via a BF16 copy.
    int8 codes are taken by no mode: dequantize them first (what the int8 scheme's
    backward does). fp8_dtype applies to fake_qat only (set elsewhere: an error).
    epilogue "dswiglu": h [M, 2K] (the forward's pre-activation) is required and
    the result is dh [M, 2K] (the SwiGLU backward of the product).
    """
    _not_here("dlhs", {"fp8_dtype": fp8_dtype}, mode in ("fake_qat", "native_fp8"),
              "to mode fake_qat only")
    return out(_core.dlhs(*arg(dout), *arg(rhs), *opt(rhs_scale), *arg(group_sizes),
                          *opt(h), mode, fp8_dtype or "e4m3fn", epilogue or "none",
                          _out_dtype(out_dtype), *_tiles(tiles), _bool("dlhs: reference", reference)))


def tgmm(lhs: Any, dout: Any, group_sizes: Any, mode: Literal["f32", "bf16"] = "bf16", *,
         dout_quant: Optional[Literal["e5m2", "e4m3fn"]] = None,
         per_group: Optional[bool] = None, calibration: Optional[str] = None,
         scale_arithmetic: Optional[ScaleArithmetic] = None,
         tiles: Tiles = None, reference: bool = False) -> np.ndarray:
    """Weight gradient: drhs [E, K, N] float32 = lhs[rows of g]^T x dout[rows of g].

    An empty group gives an all-zero slice. lhs float32 (f32) or bfloat16 (bf16), or
    fp8 codes used as their exact values. dout_quant quantizes a float32 dout
    inside the call, one scale per (group, channel) (per_group) or per (m-tile of
    tiles[0] rows, default 512, channel). per_group (default True), calibration
    (default absmax) and scale_arithmetic (default exact_divide) apply only with
    dout_quant: set without it they are an error.
    """
    _not_here("tgmm", {"per_group": per_group, "calibration": calibration,
                       "scale_arithmetic": scale_arithmetic}, dout_quant is not None,
              "when dout is quantized (dout_quant='e5m2' or 'e4m3fn') only")
    return out(_core.tgmm(*arg(lhs), *arg(dout), *arg(group_sizes), mode,
                          dout_quant or "none",
                          True if per_group is None else _bool("tgmm: per_group", per_group),
                          calibration or "absmax", scale_arithmetic or "exact_divide",
                          *_tiles(tiles), _bool("tgmm: reference", reference)))


def moe_config(**flags: Any) -> dict[str, Any]:
    """Every MoE / QAT flag of configs/base.yml with `flags` applied, validated as
    the trainer validates them. Unknown flags and invalid combinations raise
    ValueError with the message the command prints (docs/config.md)."""
    return _core.moe_config(_flags(flags))


class MoeForward(NamedTuple):
    y: np.ndarray            # [T, D] float32
    group_sizes: np.ndarray  # [E] int32
    aux_loss: float
    buffer_rows: int
    dropless_reruns: int


class MoeBackward(NamedTuple):
    forward: MoeForward
    dx: np.ndarray       # [T, D]
    drouter: np.ndarray  # [D, E]
    dwi: np.ndarray      # [E, D, 2F]
    dwo: np.ndarray      # [E, F, D]


def _forward(d: dict[str, Any]) -> MoeForward:
    return MoeForward(out(d["y"]), out(d["group_sizes"]), d["aux_loss"], d["buffer_rows"],
                      d["dropless_reruns"])


def moe_forward(x: Any, router: Any, wi: Any, wo: Any, **flags: Any) -> MoeForward:
    """The routed-expert MoE layer (docs/moe.md): x [T, D], router [D, E],
    wi [E, D, 2F] (gate | up), wo [E, F, D], all float32 (master weights).
    `flags` are the flags of configs/base.yml (num_experts must equal E)."""
    return _forward(_core.moe_forward(_flags(flags), *arg(x), *arg(router), *arg(wi),
                                      *arg(wo)))


def moe_backward(x: Any, router: Any, wi: Any, wo: Any, dy: Any, *, daux: float = 1.0,
                 **flags: Any) -> MoeBackward:
    """Gradients of sum(y * dy) + daux * aux_loss with respect to x, router, wi
    and wo (the forward runs first; its outputs come back too)."""
    d = _core.moe_backward(_flags(flags), *arg(x), *arg(router), *arg(wi), *arg(wo),
                           *arg(dy), float(daux))
    return MoeBackward(_forward(d), out(d["dx"]), out(d["drouter"]), out(d["dwi"]),
                       out(d["dwo"]))
