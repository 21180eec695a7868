"""fp8moe.jax.moe (the C++ MoE layer through XLA FFI, custom_vjp) against a JAX
implementation of the same layer (docs/moe.md, include/fp8moe/moe.h) written
here with jnp (each sorted row times its expert's weight) and differentiated
by jax.grad.

Bounds (max abs difference over max abs reference): 1e-5 in f32, as in
moe/moe_layer_reference_test.cc (seen: ~1e-7). In bf16 and fake QAT the
forward rounds where the library rounds (seen: y within 1e-7), bound 1e-2 as
in the C++ test; the gradients 3e-2 (seen: up to 1.6e-2 over 40 seeds):
jax.grad rounds every bf16 operand's cotangent to bf16 (da, and dwi, dwo
before they reach the f32 masters) where the library keeps da in f32 and
rounds dh instead, so single elements differ by a few bf16 ulps."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8moe.jax as fj

T, D, E, F, TOPK = 48, 32, 4, 16, 2


def silu(v):
    return v * jax.nn.sigmoid(v)


def fake_quant_bf16(w):
    """Per output channel (amax over axis 1) e4m3fn codes dequantized to BF16,
    bf16(f32(q) * s), in numpy: true divisions, as the library quantizes
    (jnp under jit would multiply by reciprocals, docs/numerics.md)."""
    w = np.asarray(w)
    s = (np.maximum(np.abs(w).max(axis=1, keepdims=True), np.float32(1e-12)) /
         np.float32(448)).astype(np.float32)
    q = np.clip(w / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return jnp.asarray((q.astype(np.float32) * s).astype(ml_dtypes.bfloat16))


def ste(w, presented):
    """`presented` in the forward, w's gradient straight through."""
    return jax.lax.stop_gradient(presented) + (w - jax.lax.stop_gradient(w)).astype(presented.dtype)


def moe_reference(x, router, wi, wo, *, act, presented=None, lbw=0.01, norm_topk=False):
    """The layer of include/fp8moe/moe.h, dropless, in jnp. act: the activation
    dtype (f32, or bf16 for the bf16 and quantized modes); presented: the
    weights as a QAT mode presents them (wi', wo'), with STE gradients."""
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.dot(x, router, precision=hi)
    top, idx = jax.lax.top_k(logits, TOPK)            # ties: the lower index first
    w = jax.nn.softmax(top, axis=-1)
    if norm_topk:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    flat = idx.reshape(-1)                             # pair p = t * k + j
    order = jnp.argsort(flat, stable=True)
    gs = jnp.bincount(flat, length=E).astype(jnp.int32)
    expert = flat[order]                              # the expert of each sorted row
    xs = x[order // TOPK].astype(act)
    if presented is None:
        wi_, wo_ = wi.astype(act), wo.astype(act)
    else:
        wi_, wo_ = ste(wi, presented[0]), ste(wo, presented[1])
    def expert_matmul(rows, w):  # rows [B, K] times w[expert of the row] [K, N], f32
        return jnp.einsum("bk,bkn->bn", rows, w[expert], precision=hi,
                          preferred_element_type=jnp.float32)
    h = expert_matmul(xs, wi_)                       # f32: SwiGLU reads it unrounded
    a = (silu(h[:, :F]) * h[:, F:]).astype(act)
    ys = expert_matmul(a, wo_).astype(act)
    y_pairs = jnp.zeros((T * TOPK, D), jnp.float32).at[order].set(ys.astype(jnp.float32))
    y = jnp.sum(w[:, :, None] * y_pairs.reshape(T, TOPK, D), axis=1)
    f = jax.lax.stop_gradient(gs.astype(jnp.float32) / (T * TOPK))
    p = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0)
    aux = lbw * E * jnp.sum(f * p)
    return y, aux


def inputs(rng):
    return (jnp.asarray(rng.standard_normal((T, D)), jnp.float32),
            jnp.asarray(rng.standard_normal((D, E)), jnp.float32),
            jnp.asarray(rng.standard_normal((E, D, 2 * F)) * 0.2, jnp.float32),
            jnp.asarray(rng.standard_normal((E, F, D)) * 0.2, jnp.float32),
            jnp.asarray(rng.standard_normal((T, D)), jnp.float32))


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)


CASES = [  # id, flags, reference kwargs, bound on y, bound on gradients
    ("f32", {"dtype": "float32"}, {"act": jnp.float32}, 1e-5, 1e-5),
    ("f32_norm_topk_lbw", {"dtype": "float32", "norm_topk_prob": True,
                           "load_balance_loss_weight": 0.3},
     {"act": jnp.float32, "norm_topk": True, "lbw": 0.3}, 1e-5, 1e-5),
    ("bf16", {"dtype": "bfloat16"}, {"act": jnp.bfloat16}, 1e-2, 3e-2),
    ("fake_qat", {"fp8_moe_fake_quant": True, "fp8_fake_quant_hoist": "gather8"},
     {"act": jnp.bfloat16, "presented": True}, 1e-2, 3e-2),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_moe_forward_and_grad_match_jax(case):
    _, flags, ref_kw, y_bound, g_bound = case
    flags = {"num_experts": E, "num_experts_per_tok": TOPK} | flags
    x, router, wi, wo, dy = inputs(np.random.default_rng())

    def loss(fn):
        def f(x, router, wi, wo, dy, daux):
            y, aux = fn(x, router, wi, wo)
            return jnp.sum(y * dy) + daux * aux, (y, aux)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    if ref_kw.get("presented"):
        ref_kw = ref_kw | {"presented": (fake_quant_bf16(wi), fake_quant_bf16(wo))}
    ours = loss(lambda *a: fj.moe(*a, **flags))
    ref = loss(lambda *a: moe_reference(*a, **ref_kw))
    for daux in (1.0, 3.0, 0.0):  # the aux loss's cotangent reaches the router
        (_, (y, aux)), grads = ours(x, router, wi, wo, dy, jnp.float32(daux))
        (_, (ry, raux)), rgrads = ref(x, router, wi, wo, dy, jnp.float32(daux))
        assert y.dtype == jnp.float32 and y.shape == (T, D)
        assert rel(y, ry) <= y_bound, rel(y, ry)
        assert abs(float(aux) - float(raux)) <= 1e-6 * max(abs(float(raux)), 1e-3)
        for name, g, r in zip(("dx", "drouter", "dwi", "dwo"), grads, rgrads):
            assert g.shape == r.shape and g.dtype == jnp.float32
            assert rel(g, r) <= g_bound, (name, daux, rel(g, r))


def test_moe_config_is_validated_at_trace_time():
    x, router, wi, wo, _ = inputs(np.random.default_rng())
    with pytest.raises(ValueError, match="fp8_moe_native_fwd"):
        fj.moe(x, router, wi, wo, num_experts=E, fp8_moe_native_fwd=True)
    with pytest.raises(Exception, match="router has 4 experts but num_experts = 8"):
        jax.block_until_ready(fj.moe(x, router, wi, wo, num_experts=8))
