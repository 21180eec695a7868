"""The fp8moe Python package: cast / decode / quantize / dequantize against
ml_dtypes and an independent numpy model, zero-copy arrays, the version, and
bad input raising ValueError with the library's message."""
import importlib.metadata
import pathlib
import re
import subprocess

import ml_dtypes
import numpy as np
import pytest

import fp8moe
from fp8moe import _arrays
from test_ml_dtypes import FORMATS, edge_inputs

ROOT = pathlib.Path(__file__).resolve().parents[2]
FP8 = {k: v for k, v in FORMATS.items() if k != "bf16"}
QMAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0, "e5m2": 57344.0, "e5m2fnuz": 57344.0,
        "int8": 127.0}


def bits(a):
    a = np.asarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}")


# ---- version and info ----

def test_one_version_everywhere(fp8moe_bin):
    header = (ROOT / "include/fp8moe/version.h").read_text()
    v = re.search(r'kVersion\[\] = "([0-9.]+)"', header).group(1)
    assert fp8moe.__version__ == v
    assert importlib.metadata.version("fp8moe") == v
    cli = subprocess.run([fp8moe_bin, "info"], capture_output=True, text=True, check=True)
    assert v in cli.stdout
    text = fp8moe.info()
    assert v in text and fp8moe.simd_target() in text


# ---- cast and decode against ml_dtypes, bit for bit ----

@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("saturate", [False, True])
def test_cast_matches_ml_dtypes(fmt, saturate):
    x = edge_inputs(fmt, np.random.default_rng())
    dt = FORMATS[fmt]
    with np.errstate(invalid="ignore", over="ignore"):
        src = np.clip(x, -ml_dtypes.finfo(dt).max, ml_dtypes.finfo(dt).max) if saturate else x
        want = src.astype(dt)
    got = fp8moe.cast(x, fmt, saturate=saturate)
    assert got.dtype == dt and got.shape == x.shape
    if fmt == "bf16":  # NaN payloads: ml_dtypes keeps them, fp8moe makes a quiet NaN
        nan = np.isnan(x)
        assert np.array_equal(bits(got)[~nan], bits(want)[~nan])
        assert np.isnan(got[nan].astype(np.float32)).all()
    else:
        assert np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("fmt", list(FP8))
def test_decode_every_code(fmt):
    codes = np.arange(256, dtype=np.uint8).view(FP8[fmt])
    got = fp8moe.decode(codes)
    want = codes.astype(np.float32)
    assert got.dtype == np.float32
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(bits(got)[~nan], bits(want)[~nan])


def test_decode_bf16_and_shapes_kept():
    x = np.random.default_rng().standard_normal((3, 4, 5)).astype(ml_dtypes.bfloat16)
    got = fp8moe.decode(x)
    assert got.shape == (3, 4, 5) and np.array_equal(got, x.astype(np.float32))


# ---- quantize against a numpy model (exact_divide: docs/design.md §3.2) ----

def model_codes(x, scale, dtype):
    v = (np.asarray(x, np.float32) / np.asarray(scale, np.float32)).astype(np.float32)
    if dtype == "int8":
        return np.clip(np.rint(np.nan_to_num(v, nan=0.0)), -127, 127).astype(np.int8)
    with np.errstate(invalid="ignore"):
        return np.clip(v, -QMAX[dtype], QMAX[dtype]).astype(FP8[dtype])


def model_scale(amax, dtype):
    return (np.maximum(np.float32(amax), np.float32(1e-12)) / np.float32(QMAX[dtype])).astype(np.float32)


def random_rows(rng, rows, cols):
    mags = np.exp2(rng.integers(-30, 20, size=(rows, 1))).astype(np.float32)
    return (rng.standard_normal((rows, cols)) * mags).astype(np.float32)


@pytest.mark.parametrize("dtype", list(QMAX))
def test_quantize_rows_blocks_tensor_channels(dtype):
    rng = np.random.default_rng()
    x = random_rows(rng, 9, 300)
    x[2] = 0.0
    # per row, full K and K-blocks of 128 (the last one short)
    for block in (0, 128):
        q, s = fp8moe.quantize(x, dtype, "row", block_size=block)
        bs = block or 300
        assert s.shape == (9, -(-300 // bs))
        for b0 in range(0, 300, bs):
            blk = x[:, b0:b0 + bs]
            sc = model_scale(np.abs(blk).max(axis=1, keepdims=True), dtype)
            assert np.array_equal(bits(s[:, b0 // bs]), bits(sc[:, 0]))
            assert np.array_equal(bits(q[:, b0:b0 + bs]), bits(model_codes(blk, sc, dtype)))
    # per tensor
    q, s = fp8moe.quantize(x, dtype, "tensor")
    sc = model_scale(np.abs(x).max(), dtype)
    assert s.shape == (1,) and bits(s)[0] == bits(sc)
    assert np.array_equal(bits(q), bits(model_codes(x, sc, dtype)))
    # per output channel of [E, K, N]
    w = random_rows(rng, 3 * 20, 17).reshape(3, 20, 17)
    q, s = fp8moe.quantize(w, dtype, "channel")
    sc = model_scale(np.abs(w).max(axis=1, keepdims=True), dtype)
    assert np.array_equal(bits(s), bits(sc[:, 0, :]))
    assert np.array_equal(bits(q), bits(model_codes(w, sc, dtype)))
    # dequantize is f32(q) * scale
    back = fp8moe.dequantize(q, s, "channel")
    assert np.array_equal(bits(back), bits(q.astype(np.float32) * s[:, None, :]))


def test_quantize_valid_rows_and_group_tiles():
    rng = np.random.default_rng()
    x = random_rows(rng, 40, 24)
    x[30:] = np.nan  # tail rows: never read
    q, s = fp8moe.quantize(x, "e4m3fn", "row", valid_rows=30)
    assert (bits(q[30:]) == 0).all() and (s[30:] == 0).all() and np.isfinite(s).all()
    sizes = np.array([7, 0, 20, 3], np.int32)  # 30 valid rows
    for tile_m in (0, 4):
        q, s = fp8moe.quantize(x, "e5m2", "group_tile", group_sizes=sizes, tile_m=tile_m)
        t, off = 0, 0
        for size in sizes:
            step = tile_m or max(size, 1)
            for t0 in range(0, max(size, 1 if tile_m == 0 else 0), step):
                rows = x[off + t0:off + min(t0 + step, size)]
                amax = np.abs(rows).max(axis=0) if len(rows) else np.zeros(24, np.float32)
                sc = model_scale(amax, "e5m2")
                assert np.array_equal(bits(s[t]), bits(sc))
                assert np.array_equal(bits(q[off + t0:off + t0 + len(rows)]),
                                      bits(model_codes(rows, sc, "e5m2")))
                t += 1
            off += size
        assert t == s.shape[0]
        assert (bits(q[30:]) == 0).all()
        back = fp8moe.dequantize(q, s, "group_tile", group_sizes=sizes, tile_m=tile_m)
        assert (back[30:] == 0).all() and np.isfinite(back).all()


# ---- zero copy ----

def test_inputs_are_viewed_and_outputs_are_fresh_aligned_arrays():
    x = np.random.default_rng().standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
    a, name = _arrays.arg(x)
    assert name == "bfloat16" and np.shares_memory(a, x)  # a view, not a copy
    y = fp8moe.cast(x.astype(np.float32), "e4m3fn")
    assert y.ctypes.data % 64 == 0 and y.flags.c_contiguous and y.flags.writeable
    ro = np.arange(12, dtype=np.float32).reshape(3, 4)
    ro.flags.writeable = False
    fp8moe.cast(ro, "e5m2")  # read-only inputs are fine


# ---- bad input: ValueError with the library's message ----

def test_bad_inputs_raise_value_error():
    x = np.ones((4, 6), np.float32)
    with pytest.raises(ValueError, match=r"cast: x with shape \[4, 3\] is not C-contiguous.*np.ascontiguousarray"):
        fp8moe.cast(x[:, ::2], "e4m3fn")
    with pytest.raises(ValueError, match="cast: x has dtype f64; expected f32"):
        fp8moe.cast(x.astype(np.float64), "e4m3fn")
    with pytest.raises(ValueError, match="unknown fp8 format|unknown"):
        fp8moe.cast(x, "e4m3")
    with pytest.raises(ValueError, match="granularity row needs a rank-2"):
        fp8moe.quantize(np.ones(5, np.float32), "e4m3fn", "row")
    with pytest.raises(ValueError, match="unknown scale arithmetic 'xla'"):
        fp8moe.quantize(x, "e4m3fn", scale_arithmetic="xla")
    with pytest.raises(ValueError, match="unknown calibration"):
        fp8moe.quantize(x, "e4m3fn", calibration="maxabs")
    with pytest.raises(ValueError, match=r"group_sizes\[1\] = -2 is negative"):
        fp8moe.quantize(x, "e4m3fn", "group_tile", group_sizes=np.array([1, -2], np.int32))
    with pytest.raises(ValueError, match="scale has shape"):
        fp8moe.dequantize(np.zeros((4, 6), ml_dtypes.float8_e4m3fn), np.ones((3, 1), np.float32))
    with pytest.raises(ValueError, match="unknown dtype 'complex64'"):
        fp8moe.cast(x.astype(np.complex64), "e4m3fn")


@pytest.mark.parametrize("arith", ["exact_divide", "xla_reciprocal"])
@pytest.mark.parametrize("granularity,block", [("row", 0), ("row", 128), ("channel", 0),
                                               ("tensor", 0)])
def test_quantize_equals_op_quantize(run_op, arith, granularity, block):
    """The op's scale_arithmetic key and the package's argument are one option."""
    rng = np.random.default_rng()
    x = random_rows(rng, 24, 256)
    if granularity == "channel":
        x = x.reshape(3, 8, 256)
    q, s = fp8moe.quantize(x, "e4m3fn", granularity, block_size=block,
                           scale_arithmetic=arith)
    code, out, err = run_op("quantize", {"x": x}, f"granularity={granularity}",
                            f"block_size={block}", f"scale_arithmetic={arith}")
    assert code == 0, err
    assert np.array_equal(bits(q), bits(out["q"])) and np.array_equal(bits(s), bits(out["scale"]))
    other = "exact_divide" if arith == "xla_reciprocal" else "xla_reciprocal"
    _, s2 = fp8moe.quantize(x, "e4m3fn", granularity, block_size=block, scale_arithmetic=other)
    if granularity != "tensor":  # half the scales differ; one tensor scale may not
        assert not np.array_equal(bits(s), bits(s2))
