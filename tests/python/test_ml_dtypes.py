"""Differential check: `fp8moe op cast` / `op decode` against ml_dtypes, bit for
bit, for the four fp8 formats and bf16 (docs/design.md §3.1)."""
import ml_dtypes
import numpy as np
import pytest

FORMATS = {
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2": ml_dtypes.float8_e5m2,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "bf16": ml_dtypes.bfloat16,
}


def _bits_dtype(fmt):
    return np.uint16 if fmt == "bf16" else np.uint8


def edge_inputs(fmt, rng):
    """Every representable value, every midpoint and their f32 neighbours,
    specials, random bit patterns and random values across the range."""
    dt = FORMATS[fmt]
    finfo = ml_dtypes.finfo(dt)
    if fmt == "bf16":
        reps = np.arange(0, 1 << 16, 7, dtype=np.uint16).view(dt).astype(np.float32)
    else:
        reps = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    reps = np.sort(reps[np.isfinite(reps)])
    # One ulp past max, as if the exponent range went on: the midpoint between
    # it and max is the overflow edge (e4m3fn: 464).
    step_past_max = float(reps[-1]) + (float(reps[-1]) - float(reps[-2]))
    grid = np.concatenate([reps, [step_past_max, -step_past_max]]).astype(np.float64)
    grid = np.unique(grid)
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    with np.errstate(over="ignore"):
        pts = np.concatenate([reps, mids, grid.astype(np.float32)])
    around = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                             np.nextafter(pts, np.float32(-np.inf))])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan,
                         1e-45, -1e-45, 3.4e38, -3.4e38], dtype=np.float32)
    payload_nans = np.array([0x7F800001, 0xFFC00001, 0x7FA00000], dtype=np.uint32).view(np.float32)
    random_bits = rng.integers(0, 1 << 32, size=500_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    top = float(finfo.max) * 1.2
    with np.errstate(over="ignore"):
        random_vals = rng.uniform(-top, top, size=300_000).astype(np.float32)
    tiny = rng.uniform(-4, 4, size=200_000).astype(np.float32) * np.float32(finfo.smallest_normal)
    return np.concatenate([around, specials, payload_nans, random_bits, random_vals, tiny])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("saturate", [False, True])
def test_cast_matches_ml_dtypes(run_op, fmt, saturate):
    rng = np.random.default_rng()
    x = edge_inputs(fmt, rng)
    dt = FORMATS[fmt]
    with np.errstate(invalid="ignore", over="ignore"):
        if saturate:
            m = np.float32(ml_dtypes.finfo(dt).max)
            want = np.clip(x, -m, m).astype(dt)
        else:
            want = x.astype(dt)
    code, out, err = run_op("cast", {"x": x.reshape(-1, 10) if x.size % 10 == 0 else x},
                            f"format={fmt}", f"saturate={'true' if saturate else 'false'}")
    assert code == 0, err
    got = out["y"].reshape(-1)
    assert got.dtype == want.dtype
    gb, wb = got.view(_bits_dtype(fmt)), want.view(_bits_dtype(fmt))
    bad = np.nonzero(gb != wb)[0]
    assert bad.size == 0, (f"{bad.size} mismatches, first x={x[bad[0]]!r} "
                           f"(bits {x.view(np.uint32)[bad[0]]:#010x}) got {gb[bad[0]]:#x} "
                           f"want {wb[bad[0]]:#x}")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decode_matches_ml_dtypes(run_op, fmt):
    dt = FORMATS[fmt]
    n = 1 << 16 if fmt == "bf16" else 256
    codes = np.arange(n, dtype=np.uint64).astype(_bits_dtype(fmt)).view(dt)
    code, out, err = run_op("decode", {"y": codes})
    assert code == 0, err
    want = codes.astype(np.float32).view(np.uint32)
    got = out["x"].view(np.uint32)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"code {bad[0]:#x}: got {got[bad[0]]:#010x} want {want[bad[0]]:#010x}"


def test_decode_u8_needs_format(run_op):
    codes = np.arange(256, dtype=np.uint8)
    code, _, err = run_op("decode", {"y": codes})
    assert code == 2 and "format=" in err
    code, out, err = run_op("decode", {"y": codes}, "format=e5m2fnuz")
    assert code == 0, err
    want = codes.view(ml_dtypes.float8_e5m2fnuz).astype(np.float32).view(np.uint32)
    assert np.array_equal(out["x"].view(np.uint32), want)


QMAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0, "e5m2": 57344.0, "e5m2fnuz": 57344.0, "int8": 127.0}


def numpy_quantize(x, dtype, axis):
    """docs/design.md §3.2 in numpy: scale = max(amax, 1e-12) / fmax, q = sat(x / scale)."""
    amax = np.max(np.abs(x), axis=axis, keepdims=True) if axis is not None else np.max(np.abs(x))
    scale = (np.maximum(amax, np.float32(1e-12)) / np.float32(QMAX[dtype])).astype(np.float32)
    v = (x / scale).astype(np.float32)
    if dtype == "int8":
        q = np.clip(np.rint(v), -127, 127).astype(np.int8)
    else:
        m = np.float32(QMAX[dtype])
        q = np.clip(v, -m, m).astype(FORMATS[dtype])
    return q, scale


@pytest.mark.parametrize("dtype", list(QMAX))
@pytest.mark.parametrize("granularity", ["tensor", "row", "channel"])
def test_quantize_matches_numpy(run_op, dtype, granularity):
    rng = np.random.default_rng()
    shape = (3, 40, 24) if granularity == "channel" else (50, 96)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 10, size=shape[:-1] + (1,)))).astype(np.float32)
    axis = {"tensor": None, "row": 1, "channel": 1}[granularity]
    want_q, want_s = numpy_quantize(x, dtype, axis)
    code, out, err = run_op("quantize", {"x": x}, f"dtype={dtype}", f"granularity={granularity}")
    assert code == 0, err
    bits = np.uint8
    assert np.array_equal(out["q"].view(bits), want_q.view(bits))
    assert np.array_equal(out["scale"].reshape(-1), np.asarray(want_s, np.float32).reshape(-1))
    # dequantize round trip equals q * scale
    code, back, err = run_op("dequantize", {"q": out["q"], "scale": out["scale"]},
                             f"granularity={granularity}")
    assert code == 0, err
    want_x = want_q.astype(np.float32) * np.asarray(want_s, np.float32)
    assert np.array_equal(back["x"], want_x.reshape(back["x"].shape))


def test_fixed_calibration_clips(run_op):
    x = np.array([[1.0, -300.0, 224.0, 500.0]], np.float32)
    code, out, err = run_op("quantize", {"x": x}, "granularity=tensor", "calibration=fixed,-224,224")
    assert code == 0, err
    assert out["scale"][0] == 0.5
    assert list(out["q"].astype(np.float32).reshape(-1) * 0.5) == [1.0, -224.0, 224.0, 224.0]


@pytest.mark.parametrize("keys,needle", [
    (["formt=e5m2"], "did you mean 'format'"),
    (["format=e4m3"], "e4m3fn"),
    (["saturate=yes"], "saturate"),
    (["format"], "key=value"),
])
def test_bad_keys_exit_2(run_op, keys, needle):
    code, _, err = run_op("cast", {"x": np.zeros(4, np.float32)}, *keys)
    assert code == 2
    assert needle in err, err


def test_missing_tensor_and_wrong_dtype_exit_2(run_op):
    code, _, err = run_op("cast", {"z": np.zeros(4, np.float32)})
    assert code == 2 and "'x'" in err, err
    code, _, err = run_op("cast", {"x": np.zeros(4, np.float64)})
    assert code == 2 and "f64" in err and "f32" in err, err
    code, _, err = run_op("quantize", {"x": np.zeros((2, 3, 4, 5), np.float32)}, "granularity=row")
    assert code == 2 and "rank-2" in err, err
    code, _, err = run_op("dequantize", {"q": np.zeros((2, 4), np.int8), "scale": np.zeros((3, 1), np.float32)})
    assert code == 2 and "needs [2, 1]" in err, err
    code, _, err = run_op("castt", {"x": np.zeros(4, np.float32)})
    assert code == 2 and "did you mean 'cast'" in err, err
