"""The fp8moe of a plain `pip install .` (pip's isolated build) has its XLA FFI
handlers: scripts/test runs this with the Python of a fresh virtual environment
that holds only numpy, ml_dtypes, jax and that fp8moe (no pytest, so it is a
script). Under jax.jit, jax.grad through fp8moe.jax.gmm (f32 mode) equals
jax.grad through jax.lax.ragged_dot within f32 summation error: |got - want| <=
1e-5 * sum |a b| per element of the valid rows (a sum of at most 70 products is
within 70 * 2^-24 < 4.2e-6 of sum |a b| of the exact value, on either side)."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fp8moe
import fp8moe.jax as fj

sizes = np.array([0, 7, 0, 20, 3], np.int32)  # empty groups, 7 tail rows
m, k, n = 37, 130, 70
rng = np.random.default_rng()
lhs = rng.standard_normal((m, k)).astype(np.float32)
lhs[sizes.sum():] = 0  # tail rows: ragged_dot would multiply NaN into its sum
rhs = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
ct = rng.standard_normal((m, n)).astype(np.float32)
gs = jnp.asarray(sizes)


def grads(f):
    loss = lambda l, r: jnp.sum(f(l, r) * ct)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(lhs), jnp.asarray(rhs))


got = grads(lambda l, r: fj.gmm(l, r, gs, "f32"))
want = grads(lambda l, r: jax.lax.ragged_dot(l, r, gs))
# sum |a b| of each gradient element: dlhs = ct rhs[g]^T, drhs[g] = lhs^T ct.
bound_dl = np.zeros((m, k))
bound_dr = np.zeros((len(sizes), k, n))
off = 0
for g, s in enumerate(sizes):
    rows = slice(off, off + s)
    bound_dl[rows] = np.abs(ct[rows]).astype(np.float64) @ np.abs(rhs[g]).T
    bound_dr[g] = np.abs(lhs[rows]).T.astype(np.float64) @ np.abs(ct[rows])
    off += s
failed = False
valid = int(sizes.sum())  # ragged_dot's dlhs of tail rows is not fp8moe's contract
for name, a, b, bound in (("dlhs", got[0][:valid], want[0][:valid], bound_dl[:valid]),
                          ("drhs", got[1], want[1], bound_dr)):
    err = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    worst = float(np.max(err / (bound + 1e-30)))
    ok = bool(np.all(err <= 1e-5 * bound + 1e-30))
    failed |= not ok
    print(f"  {name}: max |fp8moe - ragged_dot| / sum|ab| = {worst:.3g} (bound 1e-5) "
          f"{'ok' if ok else 'FAILED'}")
print(f"  {fp8moe.info()}; jax {jax.__version__}")
sys.exit(1 if failed else 0)
