"""fp8moe.jax.gmm (XLA FFI + custom_vjp) against jax.lax.ragged_dot and its VJP,
under jax.jit, on ragged groups (empty groups, tail rows).

fp8moe gets NaN in its tail rows (never read, outputs 0 there); ragged_dot gets
zeros there (it would multiply the NaN into its masked dense product). Float
results agree within RTOL * sum|a*b| (f32 accumulation in another order), plus
the output's own rounding for bf16 outputs. Quantized modes are compared with
ragged_dot on the dequantized operands (the weight fake-quantized with a
straight-through estimator, in jnp), which is what the modes define."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8moe
import fp8moe.jax as fj

BF16 = jnp.bfloat16
SIZES = np.array([0, 7, 0, 20, 3], np.int32)
M, K, N = 37, 130, 70
VALID = int(SIZES.sum())
RTOL = 1e-5
QMAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0, "int8": 127.0}


def f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def data(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-1.5, 1.5, shape[-1])) *
            scale).astype(np.float32)


def with_tail(x, fill):
    x = np.array(x)
    x[VALID:] = fill
    return x


def bf16_exact(x):
    """f32 values that bf16 holds exactly (so rounding a cotangent to bf16 is exact)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def bound(a, b):
    """sum over the contraction of |a * b|, per output element (float64)."""
    return np.abs(f64(a)) @ np.abs(f64(b))


def grouped(a, w, sizes, transpose=False):
    """out[rows of g] = a[rows] @ w[g] (or w[g]^T) and its bound, float64."""
    a, w = f64(a), f64(w)
    if transpose:
        w = w.transpose(0, 2, 1)
    out = np.zeros((a.shape[0], w.shape[2]))
    bnd = np.zeros_like(out)
    off = 0
    for g, s in enumerate(sizes):
        out[off:off + s] = a[off:off + s] @ w[g]
        bnd[off:off + s] = np.abs(a[off:off + s]) @ np.abs(w[g])
        off += s
    return out, bnd


def grouped_t(a, d, sizes):
    """drhs[g] = a[rows of g]^T @ d[rows of g] and its bound."""
    a, d = f64(a), f64(d)
    out = np.zeros((len(sizes), a.shape[1], d.shape[1]))
    bnd = np.zeros_like(out)
    off = 0
    for g, s in enumerate(sizes):
        out[g] = a[off:off + s].T @ d[off:off + s]
        bnd[g] = np.abs(a[off:off + s]).T @ np.abs(d[off:off + s])
        off += s
    return out, bnd


def close(got, want, bnd, what, bf16_out=False, rows=None):
    # Against an exact (float64) want, a bf16 output is off by its own rounding:
    # half an ulp, <= 2^-8 relative. Against another library's bf16 output both
    # are rounded, and two roundings of nearly equal sums (f32 accumulation in
    # another order) can land a whole ulp apart: <= 2^-7 relative (a CI run
    # saw dlhs 1 ulp apart, 0.0148 over the half-ulp tolerance).
    exact = isinstance(want, np.ndarray) and want.dtype == np.float64
    got = f64(got)
    want = want if exact else f64(want)
    assert not np.isnan(got).any(), f"{what}: NaN"
    if rows is not None:
        assert (got[rows:] == 0).all(), f"{what}: tail rows not zero"
    rounding = (2.0 ** -8 if exact else 2.0 ** -7) if bf16_out else 2.0 ** -23
    tol = RTOL * bnd + np.abs(want) * rounding + 1e-30
    err = np.abs(got - want)
    assert (err <= tol).all(), f"{what}: max excess {np.max(err - tol):.3g}"


def vjp_jit(f, *primals_and_ct):
    *primals, ct = primals_and_ct
    def run(*args):
        out, pull = jax.vjp(f, *args[:-1])
        return out, pull(args[-1])
    return jax.jit(run)(*primals, ct)


# ---- f32 and bf16 against ragged_dot and its VJP ----

@pytest.mark.parametrize("mode", ["f32", "bf16"])
def test_gmm_and_vjp_match_ragged_dot(mode):
    rng = np.random.default_rng()
    dt = jnp.float32 if mode == "f32" else BF16
    lhs = jnp.asarray(data(rng, (M, K))).astype(dt)
    rhs = jnp.asarray(data(rng, (len(SIZES), K, N), 0.1)).astype(dt)
    ct = jnp.asarray(bf16_exact(data(rng, (M, N)))).astype(dt)
    gs = jnp.asarray(SIZES)
    nan_lhs = jnp.asarray(with_tail(lhs, np.nan))
    zero_lhs = jnp.asarray(with_tail(lhs, 0))
    out, (dl, dr) = vjp_jit(lambda l, r: fj.gmm(l, r, gs, mode), nan_lhs, rhs, ct)
    rout, (rdl, rdr) = vjp_jit(lambda l, r: jax.lax.ragged_dot(l, r, gs), zero_lhs, rhs, ct)
    assert out.dtype == rout.dtype == dt and dl.dtype == rdl.dtype and dr.dtype == rdr.dtype
    bf = mode == "bf16"
    _, b = grouped(zero_lhs, rhs, SIZES)
    close(out, rout, b, "out", bf, VALID)
    _, b = grouped(ct, rhs, SIZES, transpose=True)
    close(dl, rdl, b, "dlhs", bf, VALID)
    _, b = grouped_t(zero_lhs, ct, SIZES)
    close(dr, rdr, b, "drhs", bf)
    # And against float64 (not only against ragged_dot).
    want, b = grouped(zero_lhs, rhs, SIZES)
    close(out, want, b, "out vs f64", bf, VALID)


def test_group_sizes_are_traced():
    """One compiled function, new group sizes on every call."""
    rng = np.random.default_rng()
    lhs = jnp.asarray(data(rng, (M, K)))
    rhs = jnp.asarray(data(rng, (len(SIZES), K, N), 0.1))
    traces = []

    @jax.jit
    def f(l, r, gs):
        traces.append(1)
        return fj.gmm(l, r, gs, "f32"), jax.grad(lambda r: fj.gmm(l, r, gs, "f32").sum())(r)

    for sizes in ([0, 7, 0, 20, 3], [37, 0, 0, 0, 0], [5, 5, 5, 5, 5], [0, 0, 0, 0, 0]):
        gs = jnp.asarray(np.array(sizes, np.int32))
        out, dr = f(lhs, rhs, gs)
        valid = sum(sizes)
        zero = jnp.asarray(np.where(np.arange(M)[:, None] < valid, np.asarray(lhs), 0))
        want = jax.lax.ragged_dot(zero, rhs, gs)
        _, b = grouped(zero, rhs, sizes)
        close(out, want, b, f"out {sizes}", rows=valid)
        wdr = jax.grad(lambda r: jax.lax.ragged_dot(zero, r, gs).sum())(rhs)
        _, b = grouped_t(zero, np.ones((M, N)), sizes)
        close(dr, wdr, b, f"drhs {sizes}")
    assert len(traces) == 1


# ---- quantized modes: ragged_dot on the dequantized operands ----

def quantize_np(x, fmt, axis):
    """docs/design.md §3.2 in numpy: codes (as float64 values) and f32 scales."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=axis, keepdims=True)
    s = (np.maximum(amax, np.float32(1e-12)) / np.float32(QMAX[fmt])).astype(np.float32)
    v = (x / s).astype(np.float32)
    if fmt == "int8":
        q = np.clip(np.rint(v), -127, 127)
    else:
        dt = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz}[fmt]
        q = np.clip(v, -QMAX[fmt], QMAX[fmt]).astype(dt).astype(np.float32)
    return q.astype(np.float32), s


def ste(w, w_presented):
    """The value w_presented with w's gradient passed straight through."""
    return jax.lax.stop_gradient(w_presented) + (w - jax.lax.stop_gradient(w))


@pytest.mark.parametrize("mode,fmt,lhs_f32", [
    ("fake_qat", "e4m3fn", False), ("native_fp8", "e4m3fn", True),
    ("native_fp8", "e4m3fnuz", False), ("int8", "int8", True)])
def test_quantized_modes_and_their_gradients(mode, fmt, lhs_f32):
    rng = np.random.default_rng()
    w = data(rng, (len(SIZES), K, N), 0.1)
    lhs = data(rng, (M, K))
    if not lhs_f32:
        lhs = bf16_exact(lhs)
    ct = bf16_exact(data(rng, (M, N)))
    gs = jnp.asarray(SIZES)
    lhs_dt = jnp.float32 if lhs_f32 else BF16
    nan_lhs = jnp.asarray(with_tail(lhs, np.nan)).astype(lhs_dt)
    zero_lhs = with_tail(lhs, 0)
    qw, sw = quantize_np(w, fmt, axis=1)
    w_deq = (qw * sw).astype(np.float32)  # f32(q) * s
    w_bf16 = bf16_exact(w_deq)             # the BF16 copy / in-kernel dequant
    kw = {} if mode == "int8" else {"fp8_dtype": fmt}
    out, (dl, dr) = vjp_jit(
        lambda l, r: fj.gmm(l, r, gs, mode, out_dtype=jnp.float32, **kw), nan_lhs,
        jnp.asarray(w), jnp.asarray(ct))
    # Forward.
    if mode == "fake_qat":
        want, b = grouped(zero_lhs, w_bf16, SIZES)
    else:  # the activation quantized per row from its valid rows
        qa, sa = quantize_np(zero_lhs[:VALID], fmt, axis=1)
        a = np.zeros((M, K), np.float64)
        a[:VALID] = qa.astype(np.float64) * sa.astype(np.float64)
        want, b = grouped(a, qw.astype(np.float64) * sw.astype(np.float64), SIZES)
    close(out, want, b, "out", rows=VALID)
    # Backward against ragged_dot's VJP on the presented weight (STE to w).
    ref = lambda l, r: jax.lax.ragged_dot(l.astype(BF16), ste(r, jnp.asarray(w_bf16)).astype(BF16),
                                          gs, preferred_element_type=jnp.float32)
    _, (rdl, rdr) = vjp_jit(ref, jnp.asarray(zero_lhs), jnp.asarray(w), jnp.asarray(ct))
    assert dl.dtype == lhs_dt and dr.dtype == jnp.float32
    _, b = grouped(ct, w_bf16, SIZES, transpose=True)
    close(dl, rdl, b, "dlhs", bf16_out=True, rows=VALID)  # ragged_dot's dlhs is bf16
    _, b = grouped_t(bf16_exact(zero_lhs), ct, SIZES)
    close(dr, rdr, b, "drhs", bf16_out=True)  # and so is its drhs


def test_native_dlhs_from_codes_equals_fake_qat_bits():
    rng = np.random.default_rng()
    lhs = jnp.asarray(bf16_exact(data(rng, (M, K)))).astype(BF16)
    w = jnp.asarray(data(rng, (len(SIZES), K, N), 0.1))
    gs = jnp.asarray(SIZES)
    grads = {}
    for mode in ("fake_qat", "native_fp8"):
        f = lambda l, r: (fj.gmm(l, r, gs, mode, out_dtype=jnp.float32) ** 2).sum()
        grads[mode] = jax.jit(jax.grad(f, (0, 1)))(lhs, w)
    # The forward differs (fp8 activations), so use the same cotangent instead:
    ct = jnp.asarray(bf16_exact(data(rng, (M, N)))).astype(BF16)
    q, s = fj.quantize(w, "e4m3fn", "channel")
    a = fj.dlhs(ct, q, gs, "bf16", rhs_scale=s)        # codes, in-kernel dequant
    b = fj.dlhs(ct, q, gs, "fake_qat", rhs_scale=s)    # the BF16 copy
    assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads["native_fp8"])


def test_codes_given_get_no_gradient():
    rng = np.random.default_rng()
    lhs = jnp.asarray(data(rng, (M, K)))
    q, s = fj.quantize(jnp.asarray(data(rng, (len(SIZES), K, N), 0.1)), "e4m3fn", "channel")
    gs = jnp.asarray(SIZES)
    dl = jax.jit(jax.grad(lambda l: fj.gmm(l, q, gs, "native_fp8", rhs_scale=s).sum()))(lhs)
    assert dl.shape == lhs.shape and np.isfinite(np.asarray(dl)).all()
    assert (np.asarray(dl)[VALID:] == 0).all()


# ---- bad input ----

def test_bad_inputs_raise_with_the_library_message():
    rng = np.random.default_rng()
    lhs = jnp.asarray(data(rng, (M, K))).astype(BF16)
    rhs = jnp.asarray(data(rng, (len(SIZES), K, N))).astype(BF16)
    bad = jnp.asarray(np.array([0, -1, 0, 20, 3], np.int32))
    f = jax.jit(lambda l, r, g: fj.gmm(l, r, g, "bf16"))
    with pytest.raises(Exception, match=r"gmm: group_sizes\[1\] = -1 is negative"):
        jax.block_until_ready(f(lhs, rhs, bad))
    with pytest.raises(Exception, match="gmm: lhs has dtype f32; a bf16 GMM needs bf16"):
        jax.block_until_ready(f(lhs.astype(jnp.float32), rhs, jnp.asarray(SIZES)))
    with pytest.raises(ValueError, match=r"gmm: lhs has shape \[37\]; expected rank 2"):
        fj.gmm(lhs[:, 0], rhs, jnp.asarray(SIZES))
    with pytest.raises(ValueError, match="unknown mode 'fp8'"):
        fj.gmm(lhs, rhs, jnp.asarray(SIZES), "fp8")
    with pytest.raises(Exception, match="unknown scale arithmetic"):
        jax.block_until_ready(fj.quantize(jnp.ones((2, 3, 4)), scale_arithmetic="xla"))


def test_jax_submodule_without_ffi_handlers_says_how_to_rebuild():
    code = ("import fp8moe._core as c\nc.ffi_targets = lambda: {}\n"
            "try:\n    import fp8moe.jax\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "built without its XLA FFI handlers" in out.stdout, out.stdout + out.stderr
    assert "FP8MOE_XLA_FFI_INCLUDE_DIR" in out.stdout
    assert fp8moe._core.has_xla_ffi()


def test_fixed_weight_calibration_masks_the_ste_gradient():
    rng = np.random.default_rng()
    lhs = jnp.asarray(bf16_exact(data(rng, (M, K)))).astype(BF16)
    w = jnp.asarray(data(rng, (len(SIZES), K, N), 0.1))
    ct = jnp.asarray(bf16_exact(data(rng, (M, N))))
    gs = jnp.asarray(SIZES)
    dr = {}
    for cal in ("absmax", "fixed,-0.05,0.05"):
        f = lambda r: fj.gmm(lhs, r, gs, "fake_qat", weight_calibration=cal,
                             out_dtype=jnp.float32)
        dr[cal] = np.asarray(jax.jit(lambda r, c: jax.vjp(f, r)[1](c)[0])(w, ct))
    outside = np.abs(np.asarray(w)) > 0.05
    assert outside.any() and (~outside).any()
    assert (dr["fixed,-0.05,0.05"][outside] == 0).all()
    assert np.array_equal(dr["fixed,-0.05,0.05"][~outside], dr["absmax"][~outside])


def test_jax_options_and_arguments_give_clear_answers():
    """What a new user tried: each passed silently, truncated, or raised a
    message that named neither the argument nor the fix."""
    rng = np.random.default_rng()
    lhs = jnp.asarray(data(rng, (4, 8)))
    w = jnp.asarray(data(rng, (2, 8, 3)))
    gs = jnp.array([1, 3], jnp.int32)
    with pytest.raises(ValueError, match="quantize: dtype 'bf16'"):
        fj.quantize(w, "bf16")
    with pytest.raises(ValueError, match="quantize: x has dtype bfloat16"):
        fj.quantize(w.astype(BF16))
    with pytest.raises(ValueError, match="weight_calibration applies where"):
        fj.gmm(lhs, w, gs, "f32", weight_calibration="fixed,-1,1")
    with pytest.raises(ValueError, match="fp8_dtype applies to modes fake_qat"):
        fj.gmm(lhs, w, gs, "int8", fp8_dtype="e4m3fnuz")
    with pytest.raises(ValueError, match="lhs_calibration applies where"):
        fj.gmm(lhs.astype(BF16), w, gs, "fake_qat", lhs_calibration="fixed,-1,1")
    with pytest.raises(ValueError, match="tile m must be None or an integer"):
        fj.gmm(lhs, w, gs, "f32", tiles=(2.5, None, None))
    with pytest.raises(ValueError, match="applies when dout is quantized"):
        fj.tgmm(lhs, jnp.ones((4, 3)), gs, "f32", calibration="fixed,-1,1")
    # Group sizes as a list, and the defaults left out, give the same bits.
    a = fj.gmm(lhs, w, [1, 3], "native_fp8")
    b = fj.gmm(lhs, w, gs, "native_fp8", fp8_dtype="e4m3fn", lhs_calibration="absmax",
               weight_calibration="absmax", scale_arithmetic="exact_divide")
    assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_group_sizes_from_python_ints_under_x64():
    code = ("import jax, jax.numpy as jnp, numpy as np\n"
            "import fp8moe.jax as fj\n"
            "gs = jnp.array([2, 3])\n"
            "assert gs.dtype == jnp.int64\n"
            "out = fj.gmm(jnp.ones((5, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32), gs, 'f32')\n"
            "g = jax.grad(lambda l: fj.gmm(l, jnp.ones((2, 4, 3), jnp.float32), gs, 'f32').sum())(\n"
            "    jnp.ones((5, 4), jnp.float32))\n"
            "print(float(out.sum()), float(g.sum()))\n")
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["60.0", "60.0"], p.stdout


SUBNORMALS_AFTER_XLA = """
import numpy as np, jax
import fp8moe, fp8moe.jax as fj
M, K, N = 256, 4, 8
lhs = np.full((M, K), np.float32(2.0 ** -140), np.float32)  # subnormal
rhs = np.ones((1, K, N), np.float32)
gs = np.array([M], np.int32)
flushed = np.asarray(jax.jit(lambda x, y: x * y)(lhs, np.ones_like(lhs)))
ffi = np.asarray(jax.jit(lambda l, r, g: fj.gmm(l, r, g, "f32"))(lhs, rhs, gs))
binding = np.asarray(fp8moe.gmm(lhs, rhs, gs, "f32"))
for name, out in (("xla", flushed), ("ffi", ffi), ("binding", binding)):
    print(name, np.unique(out.view(np.uint32)).tolist())
"""


@pytest.mark.parametrize("threads", ["1", "2"])
def test_subnormals_survive_xla_flush_to_zero(threads):
    """XLA:CPU runs its computations, fp8moe's FFI handlers among them, with
    MXCSR's flush-to-zero and denormals-are-zero set (its own x * 1 flushes a
    subnormal, checked here so the test notices if that changes), and OpenMP
    workers first started inside an FFI call inherited that mode, so a later
    call from Python flushed too. fp8moe's numerics keep subnormals wherever
    it is called from: 4 x 2^-140 = 2^-138 exactly, in the FFI
    handler and in the Python binding after it, on 1 and 2 threads."""
    env = dict(os.environ, OMP_NUM_THREADS=threads, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", SUBNORMALS_AFTER_XLA], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    got = dict((line.split(" ", 1)[0], line.split(" ", 1)[1]) for line in p.stdout.splitlines())
    assert got["xla"] == "[0]", "XLA no longer flushes subnormals: " + p.stdout
    want = str([int(np.array([2.0 ** -138], np.float32).view(np.uint32)[0])])
    assert got["ffi"] == want, p.stdout
    assert got["binding"] == want, p.stdout
