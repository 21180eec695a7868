"""FP8 quantization bit for bit against qwix (the quantizer of JAX trainers) and
against the same formulas in jnp and in numpy + ml_dtypes (docs/numerics.md).

scale_arithmetic="xla_reciprocal" must equal qwix 0.1.8 under jax.jit and a jnp
transcription of qwix's formulas under jax.jit, codes and scales, at every
granularity, in every fp8 format, including rows below the scale floor and
values next to the rounding midpoints. "exact_divide" (the default) must equal
numpy's true divisions, and differs from qwix only by one-ulp scales (and the
1e-12 epsilon below it), which this file measures and checks."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from qwix._src.core import qarray

import fp8moe

FP8 = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
       "e5m2": ml_dtypes.float8_e5m2, "e5m2fnuz": ml_dtypes.float8_e5m2fnuz}
FMAX = {k: np.float32(ml_dtypes.finfo(v).max) for k, v in FP8.items()}


def bits(a):
    a = np.asarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}")


def near_midpoints(rng, fmt, s, amax, n):
    """n values next to (within 3 ulps of) the midpoints between codes times the
    scale s, where x / s and x * (1 / s) can round to different codes; |x| <= amax."""
    grid = np.unique(np.arange(256, dtype=np.uint8).view(FP8[fmt]).astype(np.float32))
    grid = grid[np.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2
    v = (rng.choice(mids, size=n) * s).astype(np.float32)
    steps = rng.integers(-3, 4, size=n)
    for k in range(3):
        v = np.where(steps > k, np.nextafter(v, np.float32(np.inf)), v)
        v = np.where(steps < -k, np.nextafter(v, np.float32(-np.inf)), v)
    return np.clip(v, -amax, amax).astype(np.float32)


def hard_rows(rng, fmt, rows, cols):
    """Rows whose amax spans 2^-80..2^30 (some below qwix's 2^-63 scale floor,
    some between it and the 1e-12 epsilon), a zero row, and rows of values
    next to the midpoints between codes."""
    mags = np.exp2(rng.uniform(-80, 30, size=(rows, 1)))
    x = (rng.standard_normal((rows, cols)) * mags).astype(np.float32)
    x[0] = 0
    x[1] *= np.float32(1e-13) / np.abs(x[1]).max()   # amax 1e-13: between floor and epsilon
    x[2] *= np.float32(1e-21) / np.abs(x[2]).max()   # scale below 2^-63: floored to 1
    for r in range(3, min(rows, 12)):
        amax = np.float32(np.exp2(rng.uniform(-10, 10)))
        s = amax * (np.float32(1) / FMAX[fmt])     # the xla scale of this row
        x[r] = near_midpoints(rng, fmt, s, amax, cols)
        x[r, 0] = amax
    return x


# ---- the three oracles of xla_reciprocal ----

def qwix_quantize(x, fmt, **how):
    """qwix 0.1.8 qarray.quantize_api under jax.jit: (codes, scale)."""
    f = jax.jit(lambda a: qarray.quantize_api(a, jnp.dtype(FP8[fmt]), **how))
    q = f(jnp.asarray(x))
    return np.asarray(q.qvalue), np.asarray(q.scale)


def jnp_quantize(x, fmt, axes):
    """qwix's formulas transcribed to jnp (amax over `axes`, scale = amax / fmax,
    scales below sqrt(tiny) -> 1, q = clip(x / scale) cast), under jax.jit."""
    def f(a):
        amax = jnp.max(jnp.abs(a), axis=axes, keepdims=True)
        s = amax / FMAX[fmt]
        s = jnp.where(s < jnp.sqrt(jnp.finfo(jnp.float32).tiny), 1.0, s).astype(jnp.float32)
        q = jnp.clip(a / s, -FMAX[fmt], FMAX[fmt]).astype(FP8[fmt])
        return q, s
    q, s = jax.jit(f)(jnp.asarray(x))
    return np.asarray(q), np.asarray(s)


def numpy_xla(x, fmt, axes):
    """The same with the reciprocals spelled out, in numpy + ml_dtypes."""
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    s = (amax * (np.float32(1) / FMAX[fmt])).astype(np.float32)
    s = np.where(s < np.float32(2.0 ** -63), np.float32(1), s)
    with np.errstate(invalid="ignore"):
        q = np.clip(x * (np.float32(1) / s), -FMAX[fmt], FMAX[fmt]).astype(FP8[fmt])
    return q, s


def numpy_exact(x, fmt, axes):
    """docs/design.md §3.2: true divisions and the 1e-12 epsilon."""
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    s = (np.maximum(amax, np.float32(1e-12)) / FMAX[fmt]).astype(np.float32)
    with np.errstate(invalid="ignore"):
        q = np.clip(x / s, -FMAX[fmt], FMAX[fmt]).astype(FP8[fmt])
    return q, s


def same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {diff.sum()} of {diff.size} differ"


# ---- granularities ----

@pytest.mark.parametrize("fmt", list(FP8))
def test_rows_and_row_blocks(fmt):
    rng = np.random.default_rng()
    x = hard_rows(rng, fmt, 64, 512)
    # per row (a token's scale over the full K)
    q, s = fp8moe.quantize(x, fmt, "row", scale_arithmetic="xla_reciprocal")
    qq, qs = qwix_quantize(x, fmt, channelwise_axes=(0,))
    same(q, qq, "row codes vs qwix")
    same(s, qs, "row scales vs qwix")
    jq, js = jnp_quantize(x, fmt, axes=1)
    same(q, jq, "row codes vs jnp")
    same(s, js, "row scales vs jnp")
    nq, ns = numpy_xla(x, fmt, axes=1)
    same(q, nq, "row codes vs numpy")
    # per row and K-block of 128
    q, s = fp8moe.quantize(x, fmt, "row", block_size=128, scale_arithmetic="xla_reciprocal")
    qq, qs = qwix_quantize(x, fmt, channelwise_axes=(0,), tiled_axes={1: 128})
    same(q, qq, "block codes vs qwix")
    same(s, qs.reshape(64, 4), "block scales vs qwix")
    jq, js = jnp_quantize(x.reshape(64, 4, 128), fmt, axes=2)
    same(q, jq.reshape(64, 512), "block codes vs jnp")
    same(s, js.reshape(64, 4), "block scales vs jnp")


@pytest.mark.parametrize("fmt", list(FP8))
def test_channels_and_tensor(fmt):
    rng = np.random.default_rng()
    # w [E, K, N]: one scale per (expert, output channel) over K
    # each (expert, channel) column is one of hard_rows' rows
    w = np.ascontiguousarray(hard_rows(rng, fmt, 3 * 24, 40).reshape(3, 24, 40).transpose(0, 2, 1))
    q, s = fp8moe.quantize(w, fmt, "channel", scale_arithmetic="xla_reciprocal")
    qq, qs = qwix_quantize(w, fmt, channelwise_axes=(0, 2))
    same(q, qq, "channel codes vs qwix")
    same(s, qs[:, 0, :], "channel scales vs qwix")
    jq, js = jnp_quantize(w, fmt, axes=1)
    same(q, jq, "channel codes vs jnp")
    # per tensor
    x = hard_rows(rng, fmt, 16, 100)[3:]
    q, s = fp8moe.quantize(x, fmt, "tensor", scale_arithmetic="xla_reciprocal")
    qq, qs = qwix_quantize(x, fmt)
    same(q, qq, "tensor codes vs qwix")
    same(s, qs.reshape(1), "tensor scale vs qwix")


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("b", [100.0, 3.7, 224.0])
def test_fixed_calibration(fmt, b):
    """qwix folds the constant b / fmax exactly; the codes still multiply by the
    reciprocal."""
    rng = np.random.default_rng()
    x = near_midpoints(rng, fmt, np.float32(b) / FMAX[fmt], np.float32(b), 4096)
    x = np.concatenate([x, np.float32([2 * b, -3 * b])])  # clipped at b
    cal = f"fixed,{-b},{b}"
    q, s = fp8moe.quantize(x, fmt, "tensor", calibration=cal, scale_arithmetic="xla_reciprocal")
    qq, qs = qwix_quantize(x, fmt, calibration_method=cal)
    same(q, qq, "fixed codes vs qwix")
    same(s, qs.reshape(1), "fixed scale vs qwix")


def test_group_tiles_against_qwix_per_tile():
    """The weight-gradient operand's scales (one per m-tile of a group and
    channel, from valid rows only) are qwix's channelwise scales of each tile."""
    rng = np.random.default_rng()
    sizes = np.array([5, 0, 70, 1, 0, 33], np.int32)
    x = hard_rows(rng, "e5m2", 128, 48)
    x = x[rng.permutation(128)]
    x[sizes.sum():] = np.nan  # tail rows
    q, s = fp8moe.quantize(x, "e5m2", "group_tile", group_sizes=sizes, tile_m=32,
                           scale_arithmetic="xla_reciprocal")
    t, off = 0, 0
    for size in sizes:
        for t0 in range(0, size, 32):
            rows = x[off + t0:off + min(size, t0 + 32)]
            qq, qs = qwix_quantize(rows, "e5m2", channelwise_axes=(1,))
            same(q[off + t0:off + t0 + len(rows)], qq, f"tile {t} codes")
            same(s[t], qs[0], f"tile {t} scales")
            t += 1
        off += size
    assert t == s.shape[0]


# ---- exact_divide: numpy's true divisions; how it differs from qwix ----

@pytest.mark.parametrize("fmt", list(FP8))
def test_exact_divide_is_true_division_and_one_ulp_from_qwix(fmt):
    rng = np.random.default_rng()
    x = hard_rows(rng, fmt, 187, 256)
    q, s = fp8moe.quantize(x, fmt, "row")
    nq, ns = numpy_exact(x, fmt, axes=1)
    same(q, nq, "exact codes vs numpy")
    same(s, ns[:, 0:1], "exact scales vs numpy")
    qq, qs = qwix_quantize(x, fmt, channelwise_axes=(0,))
    amax = np.abs(x).max(axis=1)
    big = amax >= 1e-12
    ulps = np.abs(bits(s[:, 0]).astype(np.int64) - bits(qs[:, 0]).astype(np.int64))
    assert (ulps[big] <= 1).all()
    assert (ulps[big] == 1).any(), "no scale differed: the test data do not exercise the case"
    # Below the epsilon the scales differ by design (1e-12 / fmax vs qwix's).
    assert not np.array_equal(bits(s[~big, 0]), bits(qs[~big, 0]))
