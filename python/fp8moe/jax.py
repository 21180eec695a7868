"""fp8moe kernels as JAX primitives on the CPU (XLA FFI), with gradients.

    import fp8moe.jax as fj
    out = fj.gmm(lhs, rhs, group_sizes, mode="native_fp8")    # under jax.jit too
    g = jax.grad(lambda l, r: fj.gmm(l, r, gs, mode="native_fp8").sum(), (0, 1))

Each call is one XLA custom call into the C++ library: XLA hands its buffers
over as they are (row-major, no copy) and the kernels write XLA's result
buffers in place. Gradients come from jax.custom_vjp rules that call the
library's backward kernels (dLHS, TGMM); group sizes may be traced arrays.
Errors in the data (e.g. a negative group size) are raised by XLA at run time
with the library's message. The primitives have no batching rule (no vmap).
docs/python.md has the full story.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

try:
    import jax
    import jax.numpy as jnp
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("fp8moe.jax needs jax (pip install jax); the rest of fp8moe "
                      "works without it") from e

import numpy as np

from . import _core
from . import _not_here  # the numpy API's check of keywords a mode ignores
from . import _flags_text

_TARGETS = _core.ffi_targets()
if not _TARGETS:
    raise ImportError(
        "fp8moe was built without its XLA FFI handlers: jax was not importable by the "
        "Python that built it, so jax.ffi.include_dir() (the XLA FFI headers) was "
        "unknown. Rebuild with jax there, either\n"
        "  pip install .   (pip's isolated build installs the jax pyproject.toml names)\n"
        "or, with jax, scikit-build-core and nanobind installed,\n"
        "  pip install --no-build-isolation .\n"
        "or\n"
        "  pip install . -Ccmake.define.FP8MOE_XLA_FFI_INCLUDE_DIR="
        "$(python -c 'import jax.ffi; print(jax.ffi.include_dir())')")
for _name, _capsule in _TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

__all__ = ["gmm", "dlhs", "tgmm", "quantize", "moe"]

_FLOAT_MODES = ("f32", "bf16")
_QUANT_MODES = ("fake_qat", "native_fp8", "int8")


def _check_rank(fn: str, name: str, x: Any, rank: int, dims: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{fn}: {name} has shape {list(jnp.shape(x))}; expected rank "
                         f"{rank} {dims}")


def _tile_attrs(tiles: Optional[Sequence[Optional[int]]]) -> dict[str, Any]:
    t = (None, None, None) if tiles is None else tuple(tiles)
    if len(t) != 3:
        raise ValueError(f"tiles must be (m, k, n) with None for the per-shape default; got {tiles!r}")
    for d, v in zip("mkn", t):
        # np.int64(2.5) would truncate to 2 without a word.
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                              or not 1 <= int(v) <= 1 << 20):
            raise ValueError(f"tile {d} must be None or an integer in [1, 2^20]; got {v!r}")
    return {f"tile_{d}": np.int64(-1 if v is None else v) for d, v in zip("mkn", t)}


_QUANT_DTYPES = ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "int8")


def _group_sizes(gs):
    """int32 group sizes from an array or a list; int64 (what jnp makes of Python
    ints with jax_enable_x64) is narrowed: a group size counts rows."""
    gs = jnp.asarray(gs)
    return gs.astype(jnp.int32) if gs.dtype == jnp.int64 else gs


def _call(target: str, results, *args, **attrs):
    return jax.ffi.ffi_call(target, results)(*args, **attrs)


# ---- Primitives without gradients: one FFI call each ----

def quantize(x, dtype: str = "e4m3fn", granularity: str = "channel", *, block_size: int = 0,
             calibration: str = "absmax", scale_arithmetic: str = "exact_divide"):
    """x float32 -> (q codes, scale float32), as fp8moe.quantize (granularity
    'row' [R, C] -> scale [R, blocks], 'channel' [E, K, N] -> [E, N], 'tensor'
    -> [1]). No gradient."""
    x = jnp.asarray(x)
    if dtype not in _QUANT_DTYPES:
        raise ValueError(f"quantize: dtype {dtype!r}; expected one of {', '.join(_QUANT_DTYPES)}")
    if x.dtype != jnp.float32:
        raise ValueError(f"quantize: x has dtype {x.dtype}; expected float32 (x.astype(jnp.float32))")
    if granularity == "row":
        _check_rank("quantize", "x", x, 2, "[R, C]")
        blocks = 1 if block_size <= 0 else -(-x.shape[1] // block_size)
        sshape = (x.shape[0], blocks)
    elif granularity == "channel":
        _check_rank("quantize", "x", x, 3, "[E, K, N]")
        sshape = (x.shape[0], x.shape[2])
    elif granularity == "tensor":
        sshape = (1,)
    else:
        raise ValueError(f"quantize: granularity {granularity!r}; expected row, channel or tensor")
    qdt = jnp.int8 if dtype == "int8" else jnp.dtype(f"float8_{dtype}")
    return _call("fp8moe_quantize",
                 (jax.ShapeDtypeStruct(x.shape, qdt), jax.ShapeDtypeStruct(sshape, jnp.float32)),
                 x, granularity=granularity, block_size=np.int64(block_size),
                 calibration=calibration, scale_arithmetic=scale_arithmetic)


def dlhs(dout, rhs, group_sizes, mode: str = "bf16", *, rhs_scale=None,
         fp8_dtype: Optional[str] = None, out_dtype=None, tiles=None):
    """dlhs [M, K] = dout [M, N] x rhs[g]^T per group (fp8moe.dlhs). No gradient.
    fp8_dtype (default e4m3fn) applies to mode fake_qat only."""
    _not_here("dlhs", {"fp8_dtype": fp8_dtype}, mode == "fake_qat", "to mode fake_qat only")
    fp8_dtype = fp8_dtype or "e4m3fn"
    dout, rhs, group_sizes = jnp.asarray(dout), jnp.asarray(rhs), _group_sizes(group_sizes)
    _check_rank("dlhs", "dout", dout, 2, "[M, N]")
    _check_rank("dlhs", "rhs", rhs, 3, "[E, K, N]")
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(dout))
    args = [dout, rhs] + ([] if rhs_scale is None else [rhs_scale]) + [group_sizes]
    return _call("fp8moe_dlhs", jax.ShapeDtypeStruct((dout.shape[0], rhs.shape[1]), out_dtype),
                 *args, mode=mode, fp8_dtype=fp8_dtype, epilogue="none",
                 has_scale=np.bool_(rhs_scale is not None), has_h=np.bool_(False),
                 **_tile_attrs(tiles))


def tgmm(lhs, dout, group_sizes, mode: str = "bf16", *, dout_quant: Optional[str] = None,
         per_group: Optional[bool] = None, calibration: Optional[str] = None,
         scale_arithmetic: Optional[str] = None, tiles=None):
    """drhs [E, K, N] float32 = lhs[g]^T x dout[g] per group (fp8moe.tgmm). No gradient.
    per_group (default True), calibration (absmax) and scale_arithmetic
    (exact_divide) apply only with dout_quant."""
    _not_here("tgmm", {"per_group": per_group, "calibration": calibration,
                       "scale_arithmetic": scale_arithmetic}, dout_quant is not None,
              "when dout is quantized (dout_quant='e5m2' or 'e4m3fn') only")
    per_group = True if per_group is None else per_group
    calibration, scale_arithmetic = calibration or "absmax", scale_arithmetic or "exact_divide"
    lhs, dout, group_sizes = jnp.asarray(lhs), jnp.asarray(dout), _group_sizes(group_sizes)
    _check_rank("tgmm", "lhs", lhs, 2, "[M, K]")
    _check_rank("tgmm", "dout", dout, 2, "[M, N]")
    _check_rank("tgmm", "group_sizes", group_sizes, 1, "[E]")
    shape = (group_sizes.shape[0], lhs.shape[1], dout.shape[1])
    return _call("fp8moe_tgmm", jax.ShapeDtypeStruct(shape, jnp.float32),
                 lhs, dout, group_sizes, mode=mode, dout_quant=dout_quant or "none",
                 per_group=np.bool_(per_group), calibration=calibration,
                 scale_arithmetic=scale_arithmetic, **_tile_attrs(tiles))


def _gmm_call(lhs, rhs, rhs_scale, group_sizes, mode, o: "_GmmOptions"):
    shape = (lhs.shape[0], rhs.shape[2])
    args = [lhs, rhs] + ([] if rhs_scale is None else [rhs_scale]) + [group_sizes]
    return _call("fp8moe_gmm", jax.ShapeDtypeStruct(shape, o.out_dtype), *args,
                 mode=mode, fp8_dtype=o.fp8_dtype, epilogue="none",
                 lhs_quant_block_size=np.int64(o.lhs_quant_block_size),
                 lhs_calibration=o.lhs_calibration, scale_arithmetic=o.scale_arithmetic,
                 has_scale=np.bool_(rhs_scale is not None), **_tile_attrs(o.tiles))


# ---- gmm with gradients ----

class _GmmOptions(NamedTuple):  # static (hashable) options of one gmm
    mode: str
    fp8_dtype: str
    lhs_quant_block_size: int
    lhs_calibration: str
    weight_calibration: str
    scale_arithmetic: str
    out_dtype: Any
    tiles: Optional[tuple]
    codes_given: bool


def _weight_codes(rhs, o: _GmmOptions):
    """The weight's codes and per-channel scales: quantized here from the float
    master weight, or given."""
    qdt = "int8" if o.mode == "int8" else o.fp8_dtype
    return quantize(rhs.astype(jnp.float32), qdt, "channel", calibration=o.weight_calibration,
                    scale_arithmetic=o.scale_arithmetic)


def _gmm_forward(o: _GmmOptions, lhs, rhs, rhs_scale, group_sizes):
    if o.mode in _FLOAT_MODES:
        return _gmm_call(lhs, rhs, None, group_sizes, o.mode, o), None
    codes, scale = (rhs, rhs_scale) if o.codes_given else _weight_codes(rhs, o)
    return _gmm_call(lhs, codes, scale, group_sizes, o.mode, o), (codes, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm(o: _GmmOptions, lhs, rhs, rhs_scale, group_sizes):
    return _gmm_forward(o, lhs, rhs, rhs_scale, group_sizes)[0]


def _gmm_fwd(o, lhs, rhs, rhs_scale, group_sizes):
    out, codes = _gmm_forward(o, lhs, rhs, rhs_scale, group_sizes)
    return out, (lhs, rhs, codes, group_sizes)


def _fixed_amax(calibration: str) -> Optional[float]:
    if not calibration.startswith("fixed,"):
        return None
    a, b = (float(v) for v in calibration.split(",")[1:3])
    return max(abs(a), abs(b))


def _gmm_bwd(o, res, dout):
    lhs, rhs, codes, group_sizes = res
    bf16 = jnp.bfloat16
    if o.mode in _FLOAT_MODES:
        dt = jnp.float32 if o.mode == "f32" else bf16
        g = dout.astype(dt)
        dl = dlhs(g, rhs, group_sizes, o.mode, out_dtype=lhs.dtype, tiles=o.tiles)
        dr = tgmm(lhs, g, group_sizes, o.mode, tiles=o.tiles).astype(rhs.dtype)
        return dl, dr, None, None
    # Quantized modes: the backward runs in bf16 (docs/design.md §4). dLHS reads the
    # codes (native_fp8: dequantized tile by tile inside the kernel, no copy;
    # fake_qat: through its BF16 copy; both give the same bits); int8 codes go
    # through a BF16 copy made here. The weight gradient reaches the float
    # master weight straight through the quantizer (STE).
    g = dout.astype(bf16)
    q, s = codes
    if o.mode == "int8":
        w = (q.astype(jnp.float32) * s[:, None, :]).astype(bf16)
        dl = dlhs(g, w, group_sizes, "bf16", out_dtype=lhs.dtype, tiles=o.tiles)
    else:
        dmode = "bf16" if o.mode == "native_fp8" else "fake_qat"
        dl = dlhs(g, q, group_sizes, dmode, rhs_scale=s,
                  fp8_dtype=o.fp8_dtype if dmode == "fake_qat" else None,
                  out_dtype=lhs.dtype, tiles=o.tiles)
    if o.codes_given:
        return dl, None, None, None
    dr = tgmm(lhs.astype(bf16), g, group_sizes, "bf16", tiles=o.tiles)
    clip = _fixed_amax(o.weight_calibration)
    if clip is not None:
        dr = jnp.where(jnp.abs(rhs.astype(jnp.float32)) > clip, 0.0, dr)
    return dl, dr.astype(rhs.dtype), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs, rhs, group_sizes, mode: str = "bf16", *, rhs_scale=None,
        fp8_dtype: Optional[str] = None, lhs_quant_block_size: int = 0,
        lhs_calibration: Optional[str] = None, weight_calibration: Optional[str] = None,
        scale_arithmetic: Optional[str] = None, out_dtype=None,
        tiles: Optional[Sequence[Optional[int]]] = None):
    """Grouped matmul out [M, N] = lhs [M, K] x rhs [E, K, N] per group, differentiable.

    group_sizes: int32 [E] (a traced array is fine); rows past sum(group_sizes)
    are tail rows, never read, written as 0.
      f32:         lhs, rhs float32.
      bf16:        lhs, rhs bfloat16 (f32 accumulation).
      fake_qat:    lhs bfloat16; rhs the float master weight, quantized per output
                   channel to fp8_dtype codes (weight_calibration) and dequantized to
                   a BF16 copy; or rhs codes + rhs_scale [E, N].
      native_fp8:  lhs float32/bfloat16, quantized per row inside the kernel
                   (lhs_quant_block_size 0/128/512, lhs_calibration); rhs as for
                   fake_qat, read as codes (no BF16 copy).
      int8:        as native_fp8 with int8 codes.
    scale_arithmetic applies to every quantization ("exact_divide" or
    "xla_reciprocal", docs/numerics.md). out_dtype defaults to lhs's dtype.

    Gradients: f32/bf16: dLHS and TGMM in the same mode. Quantized modes: dLHS in
    bf16 from the codes (native_fp8 dequantizes them inside the kernel), TGMM in
    bf16, and the weight gradient passed straight through the quantizer to the
    float rhs (zeroed where |w| exceeds a fixed calibration's range). The lhs
    gradient is plain straight-through in every mode: with a fixed
    lhs_calibration it is not zeroed where lhs was clipped (as in the MoE
    layer's backward). With rhs_scale given, rhs holds codes and gets no
    gradient, nor does rhs_scale.

    Options that a mode would ignore are errors: fp8_dtype (default e4m3fn)
    applies to fake_qat and native_fp8; lhs_calibration (absmax) to native_fp8
    and int8; weight_calibration (absmax) where rhs is a float weight quantized
    here; scale_arithmetic (exact_divide) to the quantized modes.
    """
    if mode not in _FLOAT_MODES + _QUANT_MODES:
        raise ValueError(f"gmm: unknown mode {mode!r}; expected one of "
                         f"{', '.join(_FLOAT_MODES + _QUANT_MODES)}")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), _group_sizes(group_sizes)
    quant = mode in _QUANT_MODES
    _not_here("gmm", {"fp8_dtype": fp8_dtype}, mode in ("fake_qat", "native_fp8"),
              "to modes fake_qat and native_fp8 only")
    _not_here("gmm", {"lhs_calibration": lhs_calibration}, mode in ("native_fp8", "int8"),
              "where lhs is quantized inside the call (modes native_fp8 and int8) only")
    _not_here("gmm", {"weight_calibration": weight_calibration}, quant and rhs_scale is None,
              "where rhs is a float weight quantized here (a quantized mode, no rhs_scale) only")
    _not_here("gmm", {"scale_arithmetic": scale_arithmetic},
              quant and (rhs_scale is None or mode != "fake_qat"),
              "where something is quantized here (a quantized mode; fake_qat only without "
              "rhs_scale) only")
    fp8_dtype = fp8_dtype or "e4m3fn"
    lhs_calibration = lhs_calibration or "absmax"
    weight_calibration = weight_calibration or "absmax"
    scale_arithmetic = scale_arithmetic or "exact_divide"
    _check_rank("gmm", "lhs", lhs, 2, "[M, K]")
    _check_rank("gmm", "rhs", rhs, 3, "[E, K, N]")
    if rhs_scale is not None and mode in _FLOAT_MODES:
        raise ValueError(f"gmm: rhs_scale was given but mode {mode} takes float rhs values")
    o = _GmmOptions(mode, fp8_dtype, int(lhs_quant_block_size), lhs_calibration,
                    weight_calibration, scale_arithmetic,
                    jnp.dtype(out_dtype or jnp.result_type(lhs)),
                    None if tiles is None else tuple(tiles), rhs_scale is not None)
    return _gmm(o, lhs, rhs, rhs_scale, group_sizes)


# ---- The MoE layer ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moe(config: str, x, router, wi, wo):
    return _moe_fwd(config, x, router, wi, wo)[0]


def _moe_results(x, router, wi):
    t, d = x.shape
    e = router.shape[1]
    return (jax.ShapeDtypeStruct((t, d), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.float32))


def _moe_fwd(config, x, router, wi, wo):
    y, _, aux = _call("fp8moe_moe_forward", _moe_results(x, router, wi), x, router, wi, wo,
                      config=config)
    return (y, aux), (x, router, wi, wo)


def _moe_bwd(config, res, cts):
    x, router, wi, wo = res
    dy, daux = cts
    shapes = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in res]
    return tuple(_call("fp8moe_moe_backward", shapes, x, router, wi, wo,
                       dy.astype(jnp.float32), jnp.asarray(daux, jnp.float32).reshape(()),
                       config=config))


_moe.defvjp(_moe_fwd, _moe_bwd)


def moe(x, router, wi, wo, **flags):
    """The fp8moe MoE layer (docs/moe.md) as a differentiable JAX function.

    x [T, D], router [D, E], wi [E, D, 2F], wo [E, F, D], all float32; `flags`
    are the flags of configs/base.yml, validated now (ValueError with the
    command's message). Returns (y [T, D] float32, aux_loss float32 []).
    jax.grad gives dx, drouter, dwi, dwo of any loss of y and aux_loss; the
    backward call reruns the forward inside the library (the layer's saved
    state cannot cross from one XLA call to the next).
    """
    for name, a, rank, dims in (("x", x, 2, "[T, D]"), ("router", router, 2, "[D, E]"),
                                ("wi", wi, 3, "[E, D, 2F]"), ("wo", wo, 3, "[E, F, D]")):
        _check_rank("moe", name, a, rank, dims)
    text = _flags_text.validated(flags)
    return _moe(text, x, router, wi, wo)
