"""`fp8moe op gmm | dlhs | tgmm` against an independent float64 numpy version of
the math in include/fp8moe/gmm.h, for the reference twins (reference=true) and
the fast kernels (reference=false).

Inputs are ragged: empty groups, and tail rows (past sum(group_sizes)) filled
with NaN, which must reach nothing; the outputs' tail rows must be exactly 0.
Float results are compared within rtol * sum|a*b| (the f32 accumulation
bound); integer accumulations and the quantizers are compared exactly.
"""
import ml_dtypes
import numpy as np
import pytest

BF16 = ml_dtypes.bfloat16
FP8 = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
       "e5m2": ml_dtypes.float8_e5m2}
QMAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0, "e5m2": 57344.0, "int8": 127.0}
NAN_CODE = {"e4m3fn": 0x7F, "e4m3fnuz": 0x80, "e5m2": 0x7F}

RTOL = 1e-5            # times sum|a*b|: f32 accumulation
EPILOGUE_RTOL = 2.0 ** -20  # a few f32 ulps: the fast epilogues may run in f32
M, K, N, SIZES = 37, 130, 70, [0, 7, 0, 20, 3]  # 30 valid rows, 7 tail rows
REFERENCE = pytest.mark.parametrize("reference", [True, False], ids=["ref", "fast"])


# ---- numpy model ----

def as_f64(x):
    return np.asarray(x).astype(np.float32).astype(np.float64)


def bf16_round(x):
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def quantize(x, fmt, axis):
    """Codes and f32 scales of x (f32), one scale per slice along `axis`
    (docs/design.md §3.2: scale = max(amax, 1e-12) / fmax, q = saturate(x / scale))."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=axis, keepdims=True)
    scale = (np.maximum(amax, np.float32(1e-12)) / np.float32(QMAX[fmt])).astype(np.float32)
    v = (x / scale).astype(np.float32)
    if fmt == "int8":
        q = np.clip(np.rint(v), -127, 127).astype(np.int8)
    else:
        q = np.clip(v, -QMAX[fmt], QMAX[fmt]).astype(FP8[fmt])
    return q, scale


def dequant(q, scale):
    return (q.astype(np.float32) * scale).astype(np.float32)


def quantize_channels(w, fmt):
    """w [E, K, N] -> codes [E, K, N], scale [E, N]."""
    q, s = quantize(w, fmt, axis=1)
    return q, s[:, 0, :]


def quantize_rows(x, valid, fmt, block):
    """Valid rows of x [M, K] per row (and K-block) -> dequantized rows [M, K]
    (tail rows 0) plus the integer codes and scales (int8 exactness)."""
    deq = np.zeros(x.shape, np.float64)
    codes = np.zeros(x.shape, np.float64)
    bs = block or x.shape[1]
    scales = np.zeros((x.shape[0], -(-x.shape[1] // bs)), np.float32)
    for b0 in range(0, x.shape[1], bs):
        q, s = quantize(x[:valid, b0:b0 + bs], fmt, axis=1)
        codes[:valid, b0:b0 + bs] = q.astype(np.float64)
        scales[:valid, b0 // bs] = s[:, 0]
        deq[:valid, b0:b0 + bs] = q.astype(np.float64) * s.astype(np.float64)
    return deq, codes, scales


def groups(sizes):
    off = 0
    for g, s in enumerate(sizes):
        yield g, slice(off, off + s)
        off += s


def grouped_product(a, w, sizes):
    """out[rows of g] = a[rows] @ w[g] in float64, and the bound sum|a*w|."""
    out = np.zeros((a.shape[0], w.shape[2]))
    bound = np.zeros_like(out)
    for g, rows in groups(sizes):
        out[rows] = a[rows] @ w[g]
        bound[rows] = np.abs(a[rows]) @ np.abs(w[g])
    return out, bound


def silu(x):
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def silu_grad(x):
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-x))
    return s * (1.0 + x * (1.0 - s))


def check(got, want, tol, valid, bf16_out=False, what="out"):
    """Tail rows exactly 0, no NaN, |got - want| <= tol (+ output rounding)."""
    assert got.dtype == (BF16 if bf16_out else np.float32), got.dtype
    got = got.astype(np.float64)
    assert np.all(got[valid:] == 0), f"{what}: tail rows not zero"
    assert not np.isnan(got).any(), f"{what}: NaN in the output"
    tol = tol + np.abs(want) * (2.0 ** -8 if bf16_out else 2.0 ** -23)
    err = np.abs(got - want)[:valid]
    bad = np.argwhere(err > tol[:valid])
    assert bad.size == 0, (f"{what}: {len(bad)} elements off, first {tuple(bad[0])}: "
                           f"got {got[tuple(bad[0])]!r} want {want[tuple(bad[0])]!r}")


# ---- inputs ----

def data(rng, shape, tail_from=None):
    """Normal values with per-column magnitudes spread over ~2 decades, so
    per-channel scales differ; rows >= tail_from are NaN."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-2.3, 2.3, shape[-1]))
    x = x.astype(np.float32)
    if tail_from is not None:
        x[tail_from:] = np.nan
    return x


def sizes_arr(sizes):
    return np.array(sizes, np.int32)


def keys(mode, reference, *extra):
    return [f"mode={mode}", f"reference={'true' if reference else 'false'}", *extra]


# ---- gmm ----

def gmm_case(rng, mode, rhs_kind, fp8="e4m3fn", lhs_bf16=False, block=0, m=M, k=K,
             n=N, sizes=SIZES):
    """Inputs of one gmm call and the float64 model of its product:
    (tensors, want [M, N], bound [M, N], int8 exact or None)."""
    valid = sum(sizes)
    lhs = data(rng, (m, k), valid)
    w = data(rng, (len(sizes), k, n)) * np.float32(0.1)
    t = {"lhs": lhs.astype(BF16) if lhs_bf16 else lhs, "group_sizes": sizes_arr(sizes)}
    lhs_v = bf16_round(lhs) if lhs_bf16 else lhs
    qfmt = "int8" if mode == "int8" else fp8
    if rhs_kind == "float":          # F32 values, converted by the op
        t["rhs"] = w
    elif rhs_kind == "bf16":
        t["rhs"] = w.astype(BF16)
        w = bf16_round(w)
    if mode in ("fake_qat", "native_fp8", "int8"):
        qw, sw = quantize_channels(w, qfmt)  # what the op does to a float rhs
        if rhs_kind == "codes":
            t["rhs_codes"], t["rhs_scale"] = qw, sw
    exact = None
    if mode == "f32":
        want, bound = grouped_product(as_f64(lhs_v), as_f64(w), sizes)
    elif mode == "bf16":
        want, bound = grouped_product(as_f64(bf16_round(lhs_v)), as_f64(bf16_round(w)), sizes)
    elif mode == "fake_qat":
        wq = bf16_round(dequant(qw, sw[:, None, :]))
        want, bound = grouped_product(as_f64(bf16_round(lhs_v)), as_f64(wq), sizes)
    else:  # native_fp8, int8: lhs quantized per row from its valid rows
        a_deq, a_codes, sa = quantize_rows(lhs_v, valid, qfmt,
                                          0 if mode == "int8" else block)
        w_deq = qw.astype(np.float64) * sw[:, None, :].astype(np.float64)
        want, bound = grouped_product(a_deq, w_deq, sizes)
        if mode == "int8":  # int accumulation, then (acc * sa) * sw in double
            acc, _ = grouped_product(a_codes, qw.astype(np.float64), sizes)
            exact = np.zeros_like(acc)
            for g, rows in groups(sizes):
                sa_i = sa[rows, :1].astype(np.float64)
                exact[rows] = (acc[rows] * sa_i) * sw[g].astype(np.float64)
            exact = exact.astype(np.float32)
    return t, want, bound, exact


GMM_CASES = [
    # id, mode, rhs kind, fp8, lhs given as BF16
    ("f32", "f32", "float", "e4m3fn", False),
    ("bf16_from_f32", "bf16", "float", "e4m3fn", False),
    ("bf16_bf16", "bf16", "bf16", "e4m3fn", True),
    ("fakeqat_codes", "fake_qat", "codes", "e4m3fn", True),
    ("fakeqat_codes_e5m2", "fake_qat", "codes", "e5m2", False),
    ("fakeqat_f32rhs_fnuz", "fake_qat", "float", "e4m3fnuz", False),
    ("int8_codes", "int8", "codes", "e4m3fn", False),
    ("int8_f32rhs_bf16lhs", "int8", "float", "e4m3fn", True),
]


@REFERENCE
@pytest.mark.parametrize("case", GMM_CASES, ids=[c[0] for c in GMM_CASES])
@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
def test_gmm(run_op, reference, case, out_dtype):
    _, mode, rhs_kind, fp8, lhs_bf16 = case
    t, want, bound, exact = gmm_case(np.random.default_rng(), mode, rhs_kind, fp8, lhs_bf16)
    extra = [f"out_dtype={out_dtype}"]
    if mode in ("fake_qat", "native_fp8") and rhs_kind == "float":
        extra.append(f"fp8_dtype={fp8}")
    code, out, err = run_op("gmm", t, *keys(mode, reference, *extra))
    assert code == 0, err
    bf16_out = out_dtype == "bf16"
    check(out["out"], want, RTOL * bound, sum(SIZES), bf16_out)
    if exact is not None and reference and not bf16_out:
        assert np.array_equal(out["out"], exact), "int8: not the exact (acc * sa) * sw"


@REFERENCE
@pytest.mark.parametrize("fp8", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("block", [0, 128, 512])
@pytest.mark.parametrize("variant", ["codes_f32lhs", "f32rhs_bf16lhs"])
def test_gmm_native_fp8(run_op, reference, fp8, block, variant):
    rhs_kind, lhs_bf16 = ("codes", False) if variant == "codes_f32lhs" else ("float", True)
    t, want, bound, _ = gmm_case(np.random.default_rng(), "native_fp8", rhs_kind, fp8,
                                 lhs_bf16, block)
    code, out, err = run_op("gmm", t, *keys("native_fp8", reference, f"fp8_dtype={fp8}",
                                             f"lhs_quant_block_size={block}"))
    assert code == 0, err
    check(out["out"], want, RTOL * bound, sum(SIZES))


@REFERENCE
@pytest.mark.parametrize("mode", ["f32", "bf16", "native_fp8", "int8"])
@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
def test_gmm_swiglu(run_op, reference, mode, out_dtype):
    rhs_kind = "float" if mode in ("f32", "bf16") else "codes"
    block = 128 if mode == "native_fp8" else 0
    t, h, bound, _ = gmm_case(np.random.default_rng(), mode, rhs_kind, block=block)
    extra = [f"lhs_quant_block_size={block}"] if block else []
    code, out, err = run_op("gmm", t, *keys(mode, reference, "epilogue=swiglu",
                                             f"out_dtype={out_dtype}", *extra))
    assert code == 0, err
    bf16_out = out_dtype == "bf16"
    valid, f = sum(SIZES), N // 2
    tol_h = RTOL * bound + np.abs(h) * 2.0 ** -23  # + the f32 rounding of h
    check(out["h"], h, RTOL * bound, valid, bf16_out, "h")
    gate, up = h[:, :f], h[:, f:]
    want = silu(gate) * up
    # The error of h carried through silu(gate) * up (|silu'| <= 1.1), plus a few
    # f32 ulps for evaluating the epilogue in f32 instead of double.
    tol = (1.1 * np.abs(up) * tol_h[:, :f] + np.abs(silu(gate)) * tol_h[:, f:] +
           np.abs(want) * EPILOGUE_RTOL)
    check(out["out"], want, tol, valid, bf16_out)


@REFERENCE
@pytest.mark.parametrize("shape", ["no_tail", "all_empty", "one_row"])
def test_gmm_ragged_shapes(run_op, reference, shape):
    m, k, n, sizes = {"no_tail": (30, 64, 16, [10, 0, 5, 15]),
                      "all_empty": (9, 33, 7, [0, 0, 0]),
                      "one_row": (4, 3, 5, [0, 1])}[shape]
    for mode in ("f32", "bf16"):
        t, want, bound, _ = gmm_case(np.random.default_rng(), mode, "float", m=m, k=k,
                                     n=n, sizes=sizes)
        code, out, err = run_op("gmm", t, *keys(mode, reference))
        assert code == 0, err
        check(out["out"], want, RTOL * bound, sum(sizes))


# ---- dlhs ----

def dlhs_case(rng, mode, rhs_kind, fp8="e4m3fn", dout_bf16=False):
    """dlhs[i, k] = sum_n dout[i, n] W[g, k, n] with W per mode."""
    valid = sum(SIZES)
    dout = data(rng, (M, N), valid)
    w = data(rng, (len(SIZES), K, N)) * np.float32(0.1)
    t = {"dout": dout.astype(BF16) if dout_bf16 else dout, "group_sizes": sizes_arr(SIZES)}
    if rhs_kind == "float":
        t["rhs"] = w
        wv = w if mode == "f32" else bf16_round(w)
    elif rhs_kind == "bf16":
        t["rhs"] = w.astype(BF16)
        wv = bf16_round(w)
    if mode == "fake_qat" or rhs_kind == "codes":
        qw, sw = quantize_channels(w, fp8)
        wv = dequant(qw, sw[:, None, :])  # f32(q) * s, an f32 product
        if mode != "f32":
            wv = bf16_round(wv)
        if rhs_kind == "codes":
            t["rhs_codes"], t["rhs_scale"] = qw, sw
    d = as_f64(dout if mode == "f32" else bf16_round(dout))
    want, bound = grouped_product(d, as_f64(wv).transpose(0, 2, 1), SIZES)
    return t, want, bound


DLHS_CASES = [
    ("f32", "f32", "float", False),
    ("f32_codes", "f32", "codes", False),
    ("bf16_from_f32", "bf16", "float", False),
    ("bf16_bf16", "bf16", "bf16", True),
    ("bf16_codes", "bf16", "codes", True),
    ("fakeqat_codes", "fake_qat", "codes", True),
    ("fakeqat_f32rhs", "fake_qat", "float", False),
]


@REFERENCE
@pytest.mark.parametrize("case", DLHS_CASES, ids=[c[0] for c in DLHS_CASES])
@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
def test_dlhs(run_op, reference, case, out_dtype):
    _, mode, rhs_kind, dout_bf16 = case
    t, want, bound = dlhs_case(np.random.default_rng(), mode, rhs_kind, "e4m3fn", dout_bf16)
    code, out, err = run_op("dlhs", t, *keys(mode, reference, f"out_dtype={out_dtype}"))
    assert code == 0, err
    check(out["dlhs"], want, RTOL * bound, sum(SIZES), out_dtype == "bf16", "dlhs")


@REFERENCE
@pytest.mark.parametrize("fp8", ["e4m3fn", "e4m3fnuz", "e5m2"])
def test_dlhs_native_codes_equal_fake_qat(run_op, reference, fp8):
    """gmm.h: dLHS from codes in mode bf16 is bit-identical to fake QAT's."""
    t, _, _ = dlhs_case(np.random.default_rng(), "bf16", "codes", fp8, True)
    code, a, err = run_op("dlhs", t, *keys("bf16", reference))
    assert code == 0, err
    code, b, err = run_op("dlhs", t, *keys("fake_qat", reference))
    assert code == 0, err
    assert np.array_equal(a["dlhs"].view(np.uint32), b["dlhs"].view(np.uint32))


@REFERENCE
@pytest.mark.parametrize("mode", ["f32", "bf16", "fake_qat"])
@pytest.mark.parametrize("h_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
def test_dlhs_dswiglu(run_op, reference, mode, h_dtype, out_dtype):
    rng = np.random.default_rng()
    t, da, bound = dlhs_case(rng, mode, "codes" if mode == "fake_qat" else "float")
    h = data(rng, (M, 2 * K), sum(SIZES))
    t["h"] = h.astype(BF16) if h_dtype == "bf16" else h
    hv = as_f64(bf16_round(h) if h_dtype == "bf16" else h)
    code, out, err = run_op("dlhs", t, *keys(mode, reference, "epilogue=dswiglu",
                                              f"out_dtype={out_dtype}"))
    assert code == 0, err
    gate, up = hv[:, :K], hv[:, K:]
    tol_da = RTOL * bound + np.abs(da) * 2.0 ** -23
    want = np.concatenate([da * up * silu_grad(gate), da * silu(gate)], axis=1)
    # da's error carried through, plus the f32 evaluation of the epilogue:
    # silu'(x) = s (1 + x (1 - s)) loses ~|x| ulps absolute to the cancellation
    # in 1 - s, which is large relative to silu' near its root and for big x.
    tol_gate = (np.abs(up * silu_grad(gate)) * tol_da +
                np.abs(da * up) * (1 + np.abs(gate)) * EPILOGUE_RTOL)
    tol_up = np.abs(silu(gate)) * tol_da + np.abs(da * silu(gate)) * EPILOGUE_RTOL
    tol = np.concatenate([tol_gate, tol_up], axis=1)
    check(out["dlhs"], want, tol, sum(SIZES), out_dtype == "bf16", "dh")


# ---- tgmm ----

def tgmm_model(a, b, sizes, k, n):
    """drhs[g] = a[rows]^T b[rows] in float64, and the bound."""
    want = np.zeros((len(sizes), k, n))
    bound = np.zeros_like(want)
    for g, rows in groups(sizes):
        want[g] = a[rows].T @ b[rows]
        bound[g] = np.abs(a[rows]).T @ np.abs(b[rows])
    return want, bound


def quantize_dout(dout, sizes, fmt, tile):
    """dout [M, N] -> dequantized values, one scale per (group, channel) or
    per (tile rows of a group, channel), valid rows only."""
    b = np.zeros(dout.shape, np.float64)
    for _, rows in groups(sizes):
        step = tile or max(rows.stop - rows.start, 1)
        for r0 in range(rows.start, rows.stop, step):
            r1 = min(r0 + step, rows.stop)
            q, s = quantize(dout[r0:r1], fmt, axis=0)
            b[r0:r1] = as_f64(dequant(q, s))
    return b


def check_tgmm(got, want, bound, sizes, bf16_out=False):
    assert got.dtype == (BF16 if bf16_out else np.float32)
    got = got.astype(np.float64)
    for g, s in enumerate(sizes):
        if s == 0:
            assert np.all(got[g] == 0), f"empty group {g}: slice not zero"
    assert not np.isnan(got).any()
    tol = RTOL * bound + np.abs(want) * (2.0 ** -8 if bf16_out else 2.0 ** -23)
    bad = np.argwhere(np.abs(got - want) > tol)
    assert bad.size == 0, (f"{len(bad)} elements off, first {tuple(bad[0])}: "
                           f"got {got[tuple(bad[0])]!r} want {want[tuple(bad[0])]!r}")


TGMM_CASES = [
    # id, mode, lhs kind (f32 / bf16 / fp8 format of codes), dout as BF16
    ("f32", "f32", "f32", False),
    ("bf16_from_f32", "bf16", "f32", False),
    ("bf16_bf16", "bf16", "bf16", True),
    ("bf16_codes_e4m3fn", "bf16", "e4m3fn", True),
    ("f32_codes_e5m2", "f32", "e5m2", False),
    ("f32_codes_e4m3fnuz", "f32", "e4m3fnuz", False),
]


def tgmm_lhs(rng, lhs_kind, mode, m, k, valid):
    """(tensor, float64 values) of a tgmm lhs; codes keep NaN codes in the tail."""
    lhs = data(rng, (m, k), valid)
    if lhs_kind in FP8:
        q, _ = quantize(np.nan_to_num(lhs), lhs_kind, axis=None)
        q = q.view(np.uint8).copy()
        q[valid:] = NAN_CODE[lhs_kind]
        q = q.view(FP8[lhs_kind])
        return q, as_f64(q)
    if lhs_kind == "bf16":
        return lhs.astype(BF16), as_f64(bf16_round(lhs))
    return lhs, as_f64(lhs if mode == "f32" else bf16_round(lhs))


@REFERENCE
@pytest.mark.parametrize("case", TGMM_CASES, ids=[c[0] for c in TGMM_CASES])
@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
def test_tgmm(run_op, reference, case, out_dtype):
    _, mode, lhs_kind, dout_bf16 = case
    rng = np.random.default_rng()
    valid = sum(SIZES)
    lhs, a = tgmm_lhs(rng, lhs_kind, mode, M, K, valid)
    dout = data(rng, (M, N), valid)
    b = as_f64(dout if mode == "f32" else bf16_round(dout))
    t = {"lhs": lhs, "dout": dout.astype(BF16) if dout_bf16 else dout,
         "group_sizes": sizes_arr(SIZES)}
    code, out, err = run_op("tgmm", t, *keys(mode, reference, f"out_dtype={out_dtype}"))
    assert code == 0, err
    want, bound = tgmm_model(a, b, SIZES, K, N)
    check_tgmm(out["drhs"], want, bound, SIZES, out_dtype == "bf16")


@REFERENCE
@pytest.mark.parametrize("dq", ["e5m2", "e4m3"])
@pytest.mark.parametrize("gran", ["group", "tile8", "tile_default"])
@pytest.mark.parametrize("lhs_kind", ["f32", "e4m3fn"])
def test_tgmm_dout_quant(run_op, reference, dq, gran, lhs_kind):
    rng = np.random.default_rng()
    # The default tile (512) only differs from per-group scales on a group
    # longer than 512 rows.
    m, k, n, sizes = (1100, 6, 10, [0, 1030, 50]) if gran == "tile_default" else (M, K, N, SIZES)
    valid = sum(sizes)
    lhs, a = tgmm_lhs(rng, lhs_kind, "f32", m, k, valid)
    dout = data(rng, (m, n), valid)
    tile = {"group": 0, "tile8": 8, "tile_default": 512}[gran]
    b = quantize_dout(dout, sizes, "e4m3fn" if dq == "e4m3" else dq, tile)
    extra = [f"dout_quant={dq}", f"dout_quant_granularity={'group' if tile == 0 else 'tile'}"]
    if gran == "tile8":
        extra.append("tile_m=8")
    t = {"lhs": lhs, "dout": dout, "group_sizes": sizes_arr(sizes)}
    code, out, err = run_op("tgmm", t, *keys("f32", reference, *extra))
    assert code == 0, err
    want, bound = tgmm_model(a, b, sizes, k, n)
    check_tgmm(out["drhs"], want, bound, sizes)


# ---- errors: exit code 2 and a message that names the problem ----

def _base(op):
    rng = np.random.default_rng(0)
    if op == "gmm":
        return {"lhs": data(rng, (8, 6)), "rhs": data(rng, (3, 6, 4)),
                "group_sizes": sizes_arr([2, 0, 5])}
    if op == "dlhs":
        return {"dout": data(rng, (8, 4)), "rhs": data(rng, (3, 6, 4)),
                "group_sizes": sizes_arr([2, 0, 5])}
    return {"lhs": data(rng, (8, 6)), "dout": data(rng, (8, 4)),
            "group_sizes": sizes_arr([2, 0, 5])}


def _with(op, **changes):
    t = _base(op)
    for name, v in changes.items():
        if v is None:
            del t[name]
        else:
            t[name] = v
    return t


ERRORS = [
    ("neg_size", "gmm", {"group_sizes": sizes_arr([2, -1, 5])}, [], "negative"),
    ("sum_over_m", "gmm", {"group_sizes": sizes_arr([2, 4, 5])}, [], "exceeds"),
    ("neg_size_tgmm", "tgmm", {"group_sizes": sizes_arr([-3, 0, 5])}, [], "negative"),
    ("sum_over_m_dlhs", "dlhs", {"group_sizes": sizes_arr([9, 0, 0])}, [], "exceeds"),
    ("lhs_dtype", "gmm", {"lhs": np.zeros((8, 6), np.int32)}, [], "'lhs' has dtype"),
    ("sizes_dtype", "gmm", {"group_sizes": np.array([2, 0, 5], np.int64)}, [], "group_sizes"),
    ("f32_mode_bf16_lhs", "gmm", {"lhs": np.zeros((8, 6), BF16)}, ["mode=f32"],
     "lhs has dtype bf16"),
    ("missing_sizes", "gmm", {"group_sizes": None}, [], "group_sizes"),
    ("missing_lhs", "gmm", {"lhs": None}, [], "'lhs'"),
    ("missing_rhs", "dlhs", {"rhs": None}, [], "rhs_codes"),
    ("missing_dout", "tgmm", {"dout": None}, [], "'dout'"),
    ("odd_tile_k", "gmm", {}, ["tile_k=3"], "odd"),
    ("tile_m_zero", "gmm", {}, ["tile_m=0"], "tile_m=0"),
    ("tile_n_negative", "tgmm", {}, ["tile_n=-4"], "tile_n=-4"),
    ("k_mismatch", "gmm", {"lhs": np.zeros((8, 5), np.float32)}, [], "K = 6"),
    ("sizes_count", "gmm", {"group_sizes": sizes_arr([2, 5])}, [], "experts"),
    ("rhs_and_codes", "gmm", {"rhs_codes": np.zeros((3, 6, 4), FP8["e4m3fn"]),
                               "rhs_scale": np.ones((3, 4), np.float32)},
     ["mode=fake_qat"], "both"),
    ("codes_no_scale", "gmm", {"rhs": None, "rhs_codes": np.zeros((3, 6, 4), FP8["e4m3fn"])},
     ["mode=fake_qat"], "rhs_scale"),
    ("scale_no_codes", "gmm", {"rhs_scale": np.ones((3, 4), np.float32)}, [], "rhs_codes"),
    ("bf16_mode_codes", "gmm", {"rhs": None, "rhs_codes": np.zeros((3, 6, 4), FP8["e4m3fn"]),
                                 "rhs_scale": np.ones((3, 4), np.float32)}, [], "mode bf16"),
    ("native_wrong_codes", "gmm", {"rhs": None, "rhs_codes": np.zeros((3, 6, 4), FP8["e5m2"]),
                                    "rhs_scale": np.ones((3, 4), np.float32)},
     ["mode=native_fp8"], "native_fp8"),
    ("bad_block", "gmm", {}, ["mode=native_fp8", "lhs_quant_block_size=64"],
     "lhs_quant_block_size"),
    ("swiglu_odd_n", "gmm", {"rhs": data(np.random.default_rng(), (3, 6, 5))},
     ["epilogue=swiglu"], "even"),
    ("dswiglu_in_gmm", "gmm", {}, ["epilogue=dswiglu"], "dswiglu"),
    ("dswiglu_no_h", "dlhs", {}, ["epilogue=dswiglu"], "'h'"),
    ("dswiglu_h_shape", "dlhs", {"h": np.zeros((8, 6), np.float32)}, ["epilogue=dswiglu"],
     "h has shape"),
    ("dlhs_native", "dlhs", {}, ["mode=native_fp8"], "dlhs runs in mode"),
    ("tgmm_fake_qat", "tgmm", {}, ["mode=fake_qat"], "tgmm runs in mode"),
    ("tgmm_quant_bf16_dout", "tgmm", {"dout": np.zeros((8, 4), BF16)},
     ["dout_quant=e5m2"], "quantizing dout"),
    ("granularity_without_quant", "tgmm", {}, ["dout_quant_granularity=tile"], "dout_quant"),
    ("fp8_dtype_in_bf16", "gmm", {}, ["fp8_dtype=e4m3fnuz"], "fp8_dtype"),
    ("arithmetic_in_bf16", "gmm", {}, ["scale_arithmetic=xla_reciprocal"],
     "scale_arithmetic applies to mode native_fp8 or int8"),
    ("calibration_in_fake_qat", "gmm", {}, ["mode=fake_qat", "lhs_calibration=fixed,-1,1"],
     "lhs_calibration applies"),
    ("bad_lhs_calibration", "gmm", {}, ["mode=native_fp8", "lhs_calibration=fixed,1"],
     "lhs_calibration: calibration 'fixed,1'"),
    ("bad_arithmetic", "gmm", {}, ["mode=int8", "scale_arithmetic=reciprocal"],
     "scale_arithmetic"),
    ("dout_calibration_without_quant", "tgmm", {}, ["dout_calibration=fixed,-1,1"],
     "dout_calibration applies when dout is quantized"),
    ("unknown_key", "gmm", {}, ["epilog=swiglu"], "epilogue"),
    ("bad_mode", "gmm", {}, ["mode=fp8"], "mode"),
]


@REFERENCE
@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors(run_op, reference, case):
    _, op, changes, extra, needle = case
    code, _, err = run_op(op, _with(op, **changes), *extra,
                          f"reference={'true' if reference else 'false'}")
    assert code == 2, (code, err)
    assert needle in err, err


# ---- moe_forward / moe_backward ----------------------------------------------

def _moe_inputs(rng, t=24, d=16, f=12, e=4):
    return dict(
        x=rng.standard_normal((t, d)).astype(np.float32),
        router=(rng.standard_normal((d, e)) * 0.5).astype(np.float32),
        wi=(rng.standard_normal((e, d, 2 * f)) / np.sqrt(d)).astype(np.float32),
        wo=(rng.standard_normal((e, f, d)) / np.sqrt(f)).astype(np.float32),
        dy=rng.standard_normal((t, d)).astype(np.float32),
    )


def test_moe_ops_run_and_agree(run_op):
    rng = np.random.default_rng()
    ins = _moe_inputs(rng)
    code, fwd, err = run_op("moe_forward", ins, "num_experts=4", "dtype=float32")
    assert code == 0, err
    code, bwd, err = run_op("moe_backward", ins, "num_experts=4", "dtype=float32")
    assert code == 0, err
    assert np.array_equal(fwd["y"], bwd["y"])
    assert fwd["group_sizes"].dtype == np.int32 and fwd["group_sizes"].sum() == 24 * 2
    for name, shape in [("dx", (24, 16)), ("drouter", (16, 4)), ("dwi", (4, 16, 24)), ("dwo", (4, 12, 16))]:
        assert bwd[name].shape == shape and np.isfinite(bwd[name]).all()


def _saturating_moe_inputs(rng, t=64, d=32, f=16, e=4, gap_window=None):
    """Issue 35's recipe, drawn in its order: rows 0-3 of x scaled x200 put
    their logits hundreds apart, so the softmax over the selected logits
    saturates (one weight ~1). With gap_window (lo, hi) rows 0-3 are drawn
    again until their top two logits, scaled, are lo to hi apart: the range
    where the f32 form lost everything (the issue's seed 22 had one at 16.9)."""
    x = rng.standard_normal((t, d)).astype(np.float32)
    router = (rng.standard_normal((d, e)) / np.sqrt(d)).astype(np.float32)
    for i in range(4 if gap_window else 0):
        while True:
            top2 = np.sort(200 * as_f64(x[i]) @ as_f64(router))[-2:]
            if gap_window[0] <= top2[1] - top2[0] <= gap_window[1]:
                break
            x[i] = rng.standard_normal(d).astype(np.float32)
    x[:4] *= 200
    return dict(x=x, router=router,
                wi=(rng.standard_normal((e, d, 2 * f)) / np.sqrt(d)).astype(np.float32),
                wo=(rng.standard_normal((e, f, d)) / np.sqrt(f)).astype(np.float32),
                dy=rng.standard_normal((t, d)).astype(np.float32))


def _moe_f64(t, k=2):
    """y, dx, drouter of the MoE layer (docs/moe.md, dtype=float32, no
    load-balancing loss) in float64: top-k of x @ router (ties to the lower
    expert), softmax over the k selected, experts silu(x wi_gate) * (x wi_up)
    @ wo, combined with the weights; the gradients of sum(y * dy). The
    softmax's backward is written w_j sum_i w_i (g_j - g_i), which does not
    cancel where a weight is ~1."""
    x, router, wi, wo, dy = (as_f64(t[n]) for n in ("x", "router", "wi", "wo", "dy"))
    f = wo.shape[1]
    logits = x @ router
    top = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    sel = np.take_along_axis(logits, top, 1)
    z = np.exp(sel - sel[:, :1])
    w = z / z.sum(1, keepdims=True)
    y, dx, dw = np.zeros_like(x), np.zeros_like(x), np.zeros_like(w)
    for j in range(k):
        for e in range(router.shape[1]):
            rows = top[:, j] == e
            h = x[rows] @ wi[e]
            gate, up = h[:, :f], h[:, f:]
            sig = 1 / (1 + np.exp(-gate))
            ye = (gate * sig * up) @ wo[e]
            y[rows] += w[rows, j:j + 1] * ye
            dw[rows, j] = (dy[rows] * ye).sum(1)
            da = (w[rows, j:j + 1] * dy[rows]) @ wo[e].T
            dh = np.concatenate([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], 1)
            dx[rows] += dh @ wi[e].T
    dsel = w * (w[:, None, :] * (dw[:, :, None] - dw[:, None, :])).sum(2)
    dlogits = np.zeros_like(logits)
    np.put_along_axis(dlogits, top, dsel, 1)
    return dict(y=y, dx=dx + dlogits @ router.T, drouter=x.T @ dlogits)


@pytest.mark.parametrize("seed,gap_window", [(22, None), (None, (12, 20))],
                         ids=["issue35", "fresh"])
def test_moe_backward_saturated_routing_softmax_matches_float64(run_op, seed, gap_window):
    # Issue 35: with seed 22 drouter was off by 1.2e-1 of its largest entry
    # (the f32 softmax backward w_j (g_j - sum w_i g_i) cancels where w ~ 1).
    ins = _saturating_moe_inputs(np.random.default_rng(seed), gap_window=gap_window)
    code, out, err = run_op("moe_backward", ins, "num_experts=4", "dtype=float32",
                            "load_balance_loss_weight=0")
    assert code == 0, err
    want = _moe_f64(ins)
    for name in ("y", "dx", "drouter"):
        rel = np.abs(out[name] - want[name]).max() / np.abs(want[name]).max()
        assert rel <= 1e-4, f"{name}: {rel:.2e} of its largest entry"


@pytest.mark.parametrize("keys,needle", [
    (["num_expert=4"], "did you mean 'num_experts'"),
    (["num_experts=4", "fp8_moe_native_fwd=true"], "fp8_moe_fake_quant"),
    (["num_experts=4", "moe_bwd_inkernel_quant=true"], "fp8_full"),
    (["num_experts=4", "bwd_quantization_dtype=e3m4"], "e5m2"),
    (["num_experts=3"], "num_experts"),
])
def test_moe_ops_bad_config_exit_2(run_op, keys, needle):
    rng = np.random.default_rng()
    code, _, err = run_op("moe_backward", _moe_inputs(rng), *keys)
    assert code == 2, err
    assert needle in err, err


def test_moe_ops_missing_tensor_exit_2(run_op):
    rng = np.random.default_rng()
    ins = _moe_inputs(rng)
    del ins["dy"]
    code, _, err = run_op("moe_backward", ins, "num_experts=4")
    assert code == 2 and "'dy'" in err, err


@pytest.mark.parametrize("args,needle", [
    (["--tiles", "0", "3", "0"], "k = 3 is odd"),
    (["--tiles", "0", "256"], "--tiles"),
    (["--tiles", "-1", "256", "0"], "--tiles"),
])
def test_bench_gmm_bad_tiles_exit_2(fp8moe_bin, args, needle):
    import subprocess
    p = subprocess.run([fp8moe_bin, "bench", "gmm", "--shape", "decode", "--reps", "1", *args],
                       capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr, p.stderr
