"""fp8moe.gmm / dlhs / tgmm and the MoE layer from numpy, bit for bit against
`fp8moe op` on the same inputs (the same library behind two front ends, so any
difference is a binding bug: an option dropped or mapped wrong, an array read
with the wrong dtype or layout). The math itself is checked against numpy in
test_gmm_ops.py; the inputs here are ragged (empty groups) with NaN tail rows,
which must reach nothing."""
import ml_dtypes
import numpy as np
import pytest

import fp8moe

BF16 = ml_dtypes.bfloat16
E4 = ml_dtypes.float8_e4m3fn
SIZES = np.array([0, 7, 0, 20, 3], np.int32)  # 30 valid rows
M, K, N = 37, 130, 70
VALID = int(SIZES.sum())
REFERENCE = pytest.mark.parametrize("reference", [False, True], ids=["fast", "ref"])


def same_bits(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    w = f"uint{8 * a.dtype.itemsize}"
    assert np.array_equal(a.view(w), b.view(w)), f"{what}: bits differ"


def data(rng, shape, tail_from=None):
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, shape[-1]))).astype(np.float32)
    if tail_from is not None:
        x[tail_from:] = np.nan
    return x


def weight(rng, mode, fp8="e4m3fn", n=N):
    """rhs as the mode takes it: (rhs, rhs_scale or None)."""
    w = data(rng, (len(SIZES), K, n)) * np.float32(0.1)
    if mode == "f32":
        return w, None
    if mode == "bf16":
        return w.astype(BF16), None
    q, s = fp8moe.quantize(w, "int8" if mode == "int8" else fp8, "channel")
    return q, s


def cli_keys(**kw):
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items()]


def op_tensors(d):
    return {k: v for k, v in d.items() if v is not None}


GMM_CASES = [  # id, mode, lhs dtype, fp8, block, epilogue
    ("f32", "f32", np.float32, "e4m3fn", 0, None),
    ("bf16", "bf16", BF16, "e4m3fn", 0, None),
    ("fake_qat", "fake_qat", BF16, "e4m3fn", 0, None),
    ("fake_qat_e5m2", "fake_qat", BF16, "e5m2", 0, None),
    ("native", "native_fp8", np.float32, "e4m3fn", 0, None),
    ("native_b128_fnuz_bf16", "native_fp8", BF16, "e4m3fnuz", 128, None),
    ("int8", "int8", np.float32, "e4m3fn", 0, None),
    ("f32_swiglu", "f32", np.float32, "e4m3fn", 0, "swiglu"),
    ("native_swiglu", "native_fp8", BF16, "e4m3fn", 512, "swiglu"),
]


@REFERENCE
@pytest.mark.parametrize("case", GMM_CASES, ids=[c[0] for c in GMM_CASES])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_gmm_equals_op(run_op, reference, case, out_dtype):
    _, mode, lhs_dt, fp8, block, epilogue = case
    rng = np.random.default_rng()
    lhs = data(rng, (M, K), VALID).astype(lhs_dt)
    rhs, scale = weight(rng, mode, fp8)
    got = fp8moe.gmm(lhs, rhs, SIZES, mode, rhs_scale=scale,
                     fp8_dtype=fp8 if mode in ("fake_qat", "native_fp8") else None,
                     lhs_quant_block_size=block, epilogue=epilogue, out_dtype=out_dtype,
                     return_h=epilogue is not None, reference=reference)
    out, h = got if epilogue else (got, None)
    assert (out[VALID:].astype(np.float32) == 0).all() and not np.isnan(out.astype(np.float32)).any()
    t = op_tensors({"lhs": lhs, "group_sizes": SIZES,
                    ("rhs" if scale is None else "rhs_codes"): rhs, "rhs_scale": scale})
    extra = {"fp8_dtype": fp8} if mode == "native_fp8" else {}
    if block:
        extra["lhs_quant_block_size"] = block
    if epilogue:
        extra["epilogue"] = epilogue
    code, want, err = run_op("gmm", t, *cli_keys(mode=mode, reference=reference,
                                                 out_dtype="bf16" if out_dtype == "bfloat16" else "f32",
                                                 **extra))
    assert code == 0, err
    same_bits(out, want["out"], "out")
    if epilogue:
        same_bits(h, want["h"], "h")


def test_gmm_explicit_tiles_same_bits():
    rng = np.random.default_rng()
    lhs = data(rng, (M, K), VALID).astype(BF16)
    rhs, _ = weight(rng, "bf16")
    a = fp8moe.gmm(lhs, rhs, SIZES, "bf16")
    b = fp8moe.gmm(lhs, rhs, SIZES, "bf16", tiles=(8, 32, None))
    same_bits(a, b, "tiles")
    with pytest.raises(ValueError, match="tile k = 3 is odd"):
        fp8moe.gmm(lhs, rhs, SIZES, "bf16", tiles=(None, 3, None))


DLHS_CASES = [  # id, mode, dout dtype, rhs kind, epilogue
    ("f32", "f32", np.float32, "f32", None),
    ("f32_codes", "f32", np.float32, "codes", None),
    ("bf16", "bf16", BF16, "bf16", None),
    ("bf16_codes", "bf16", BF16, "codes", None),
    ("fake_qat", "fake_qat", BF16, "codes", None),
    ("bf16_dswiglu", "bf16", BF16, "bf16", "dswiglu"),
    ("fake_qat_dswiglu", "fake_qat", BF16, "codes", "dswiglu"),
]


@REFERENCE
@pytest.mark.parametrize("case", DLHS_CASES, ids=[c[0] for c in DLHS_CASES])
def test_dlhs_equals_op(run_op, reference, case):
    _, mode, dout_dt, rhs_kind, epilogue = case
    rng = np.random.default_rng()
    dout = data(rng, (M, N), VALID).astype(dout_dt)
    rhs, scale = weight(rng, "fake_qat" if rhs_kind == "codes" else rhs_kind)
    h = data(rng, (M, 2 * K), VALID).astype(BF16) if epilogue else None
    got = fp8moe.dlhs(dout, rhs, SIZES, mode, rhs_scale=scale, h=h, epilogue=epilogue,
                      reference=reference)
    t = op_tensors({"dout": dout, "group_sizes": SIZES, "h": h,
                    ("rhs" if scale is None else "rhs_codes"): rhs, "rhs_scale": scale})
    extra = {"epilogue": epilogue} if epilogue else {}
    code, want, err = run_op("dlhs", t, *cli_keys(mode=mode, reference=reference, **extra))
    assert code == 0, err
    same_bits(got, want["dlhs"], "dlhs")
    assert (got[VALID:] == 0).all()


TGMM_CASES = [  # id, mode, lhs dtype, dout dtype, dout_quant, per_group
    ("f32", "f32", np.float32, np.float32, None, True),
    ("bf16", "bf16", BF16, BF16, None, True),
    ("codes_lhs", "bf16", E4, BF16, None, True),
    ("quant_group", "bf16", E4, np.float32, "e5m2", True),
    ("quant_tile", "bf16", E4, np.float32, "e4m3fn", False),
]


@REFERENCE
@pytest.mark.parametrize("case", TGMM_CASES, ids=[c[0] for c in TGMM_CASES])
def test_tgmm_equals_op(run_op, reference, case):
    _, mode, lhs_dt, dout_dt, dq, per_group = case
    rng = np.random.default_rng()
    lhs = data(rng, (M, K), VALID)
    lhs = fp8moe.cast(lhs, "e4m3fn", saturate=True) if lhs_dt == E4 else lhs.astype(lhs_dt)
    dout = data(rng, (M, N), VALID).astype(dout_dt)
    tiles = None if per_group else (16, None, None)
    got = fp8moe.tgmm(lhs, dout, SIZES, mode, dout_quant=dq, per_group=per_group if dq else None,
                      tiles=tiles, reference=reference)
    assert got.shape == (len(SIZES), K, N) and got.dtype == np.float32
    assert (got[0] == 0).all() and (got[2] == 0).all()  # empty groups
    extra = {}
    if dq:
        extra["dout_quant"] = "e4m3" if dq == "e4m3fn" else dq
        extra["dout_quant_granularity"] = "group" if per_group else "tile"
    if tiles:
        extra["tile_m"] = 16
    code, want, err = run_op("tgmm", {"lhs": lhs, "dout": dout, "group_sizes": SIZES},
                             *cli_keys(mode=mode, reference=reference, **extra))
    assert code == 0, err
    same_bits(got, want["drhs"], "drhs")


# ---- bad input: the library's message, as a ValueError ----

def test_gmm_bad_inputs(run_op):
    rng = np.random.default_rng()
    lhs = data(rng, (M, K), VALID).astype(BF16)
    rhs, _ = weight(rng, "bf16")
    with pytest.raises(ValueError, match="gmm: lhs has dtype f32; a bf16 GMM needs bf16"):
        fp8moe.gmm(lhs.astype(np.float32), rhs, SIZES, "bf16")
    with pytest.raises(ValueError, match=r"gmm: lhs has shape \[37, 130, 1\]; expected rank 2"):
        fp8moe.gmm(lhs[:, :, None], rhs, SIZES, "bf16")
    with pytest.raises(ValueError, match="gmm: rhs with shape .* is not C-contiguous"):
        fp8moe.gmm(lhs, np.swapaxes(rhs, 1, 2), SIZES, "bf16")
    with pytest.raises(ValueError, match="unknown gmm mode 'fp8'"):
        fp8moe.gmm(lhs, rhs, SIZES, "fp8")
    bad = SIZES.copy()
    bad[1] = -1
    with pytest.raises(ValueError) as e:
        fp8moe.gmm(lhs, rhs, bad, "bf16")
    # The command prints the same library message for the same input.
    code, _, err = run_op("gmm", {"lhs": lhs, "rhs": rhs, "group_sizes": bad}, "mode=bf16")
    assert code == 2
    msg = str(e.value)
    assert msg.startswith("gmm: group_sizes[1] = -1 is negative")
    assert msg[len("gmm: "):] in err
    with pytest.raises(ValueError, match="gmm: sum\\(group_sizes\\) = 50 exceeds"):
        fp8moe.gmm(lhs, rhs, np.array([10, 10, 10, 10, 10], np.int32), "bf16")
    with pytest.raises(ValueError, match="group_sizes has dtype int64"):
        fp8moe.gmm(lhs, rhs, SIZES.astype(np.int64), "bf16")


# ---- the MoE layer ----

MOE_FLAGS = [
    {"num_experts": 4, "num_experts_per_tok": 2, "dtype": "float32"},
    {"num_experts": 4, "num_experts_per_tok": 2, "fp8_moe_fake_quant": True,
     "fp8_fake_quant_hoist": "gather8", "fp8_moe_native_fwd": True,
     "fp8_moe_native_bwd_dlhs": True, "ragged_buffer_factor": 1.5},
    {"num_experts": 4, "num_experts_per_tok": 2, "quantization": "fp8_full",
     "use_qwix_quantization": True, "moe_bwd_inkernel_quant": True},
]


def moe_inputs(rng, t=24, d=32, e=4, f=16):
    return {"x": rng.standard_normal((t, d)).astype(np.float32),
            "router": rng.standard_normal((d, e)).astype(np.float32),
            "wi": (rng.standard_normal((e, d, 2 * f)) * 0.2).astype(np.float32),
            "wo": (rng.standard_normal((e, f, d)) * 0.2).astype(np.float32),
            "dy": rng.standard_normal((t, d)).astype(np.float32)}


@pytest.mark.parametrize("flags", MOE_FLAGS, ids=["f32", "native_dlhs", "fp8_full_inkernel"])
def test_moe_equals_op(run_op, flags):
    t = moe_inputs(np.random.default_rng())
    b = fp8moe.moe_backward(t["x"], t["router"], t["wi"], t["wo"], t["dy"], **flags)
    code, want, err = run_op("moe_backward", t, *cli_keys(**flags))
    assert code == 0, err
    same_bits(b.forward.y, want["y"], "y")
    same_bits(b.forward.group_sizes, want["group_sizes"], "group_sizes")
    assert np.float32(b.forward.aux_loss) == want["aux_loss"][0]
    for name in ("dx", "drouter", "dwi", "dwo"):
        same_bits(getattr(b, name), want[name], name)
    f = fp8moe.moe_forward(t["x"], t["router"], t["wi"], t["wo"], **flags)
    same_bits(f.y, want["y"], "forward y")


def test_moe_aux_cotangent_scales_the_aux_gradient():
    t = moe_inputs(np.random.default_rng())
    flags = MOE_FLAGS[0] | {"load_balance_loss_weight": 0.5}
    g = {a: fp8moe.moe_backward(t["x"], t["router"], t["wi"], t["wo"], t["dy"], daux=a, **flags)
         for a in (0.0, 1.0, -3.0)}
    # Linear in daux: g(-3) = g(0) - 3 (g(1) - g(0)); and the aux gradient is nonzero.
    for name in ("dx", "drouter"):
        g0, g1, g3 = (getattr(g[a], name).astype(np.float64) for a in (0.0, 1.0, -3.0))
        assert np.abs(g1 - g0).max() > 1e-4
        np.testing.assert_allclose(g3, g0 - 3 * (g1 - g0), rtol=1e-4, atol=1e-5)
    for name in ("dwi", "dwo"):  # the aux loss does not reach the expert weights
        same_bits(getattr(g[0.0], name), getattr(g[-3.0], name), name)


def test_moe_config_errors_are_the_commands(run_op):
    bad = {"num_experts": 4, "fp8_moe_native_fwd": True}
    with pytest.raises(ValueError) as e:
        fp8moe.moe_config(**bad)
    t = moe_inputs(np.random.default_rng())
    code, _, err = run_op("moe_forward", t, *cli_keys(**bad))
    assert code == 2
    msg = str(e.value)
    assert msg.startswith("moe_config: ") and "fp8_moe_native_fwd" in msg
    assert msg[len("moe_config: "):] in err
    with pytest.raises(ValueError, match="did you mean 'num_experts'"):
        fp8moe.moe_config(num_expert=4)
    cfg = fp8moe.moe_config(num_experts=4)
    assert cfg["num_experts"] == 4 and cfg["sparse_matmul"] is True
    with pytest.raises(ValueError, match="router has 4 experts but num_experts = 8"):
        fp8moe.moe_forward(t["x"], t["router"], t["wi"], t["wo"], num_experts=8)
