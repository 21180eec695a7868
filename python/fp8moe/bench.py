"""python -m fp8moe.bench: fp8moe.jax.gmm (XLA FFI) against jax.lax.ragged_dot on
the CPU, at the shapes of `fp8moe bench gmm`, side by side in one run; then the
cost of one FFI call.

Per shape and dtype (f32, bf16) it prints the time of one forward GMM under
jax.jit for ragged_dot and for fp8moe.jax.gmm, their ratio, the same fp8moe
call from numpy (fp8moe.gmm: no XLA in between), and the ceiling measured in
the same run: numpy's matmul (OpenBLAS) on a dense [valid rows, K] x [K, N]
f32 GEMM of the same FLOPs. FLOPs are 2 * valid_rows * K * N. The SwiGLU
shape ("train-fill wi") runs without the epilogue here (fp8moe.jax.gmm has
none; same FLOPs). A native_fp8 row (weight codes given, activation quantized
inside) shows the QAT forward next to ragged_dot in bf16.

The FFI section times tiny calls: a jitted no-op (JAX's dispatch floor), a
jitted fp8moe.jax.gmm with no rows (all groups empty: the FFI call plus the
library's argument checks) and with 8 rows, the same through numpy, and
ragged_dot on the 8 rows. The FFI overhead is the empty call minus the no-op.

Times on a shared machine drift: each number is the best of --reps runs
(ragged_dot calls slower than 2 s run once; the jax and numpy fp8moe calls
alternate), and ratios within one run are what to read.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import jax
import jax.numpy as jnp

import fp8moe
import fp8moe.jax as fj

# name, experts, rows, K, N, uneven groups (as `fp8moe bench gmm`)
SHAPES = [
    ("train-fill wi", 8, 16384, 1024, 2048, False),
    ("train-fill wo", 8, 16384, 1024, 1024, False),
    ("fine-grained", 64, 16384, 1024, 512, True),
    ("decode", 8, 64, 2048, 4096, False),
]


def group_sizes(e: int, m: int, uneven: bool) -> np.ndarray:
    """bench gmm's pattern: equal groups, or a fixed uneven one with empty groups."""
    g = [m // e] * e
    if uneven:
        left = m
        for i in range(e):
            v = 0 if i % 8 in (3, 6) else (m // e) * (1 + i % 5) // 2
            if i == e - 1:
                v = left
            v = min(v, left)
            g[i] = v
            left -= v
    return np.array(g, np.int32)


def best(fn, reps: int, slow_s: float = 2.0) -> float:
    """Best wall time of fn() over reps runs after one warm-up; one run if slow."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first > slow_s:
        return first
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def best_pair(fa, fb, reps: int) -> tuple[float, float]:
    """Best times of fa() and fb() over reps alternating runs (after one warm-up
    each), so drift on a shared machine hits both alike."""
    fa()
    fb()
    ta, tb = [], []
    for _ in range(reps):
        for f, out in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return min(ta), min(tb)


def per_call_us(fn, calls: int, reps: int) -> float:
    """Best over reps of the mean time of `calls` back-to-back synchronous calls."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return min(out)


def bench_shapes(names, reps, rows):
    rng = np.random.default_rng(7)
    for name, e, m, k, n, uneven in SHAPES:
        if names and not any(s in name for s in names):
            continue
        gs_np = group_sizes(e, m, uneven)
        valid = int(gs_np.sum())
        flops = 2.0 * valid * k * n
        a32 = rng.standard_normal((m, k)).astype(np.float32)
        w32 = (rng.standard_normal((e, k, n)) * 0.03).astype(np.float32)
        # Ceiling: a dense GEMM of the same FLOPs through numpy (OpenBLAS).
        da, db = a32[:valid], w32[0]
        t_ceiling = best(lambda: np.matmul(da, db), reps)
        gs = jnp.asarray(gs_np)
        for dt_name, dt in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
            lhs, rhs = jnp.asarray(a32).astype(dt), jnp.asarray(w32).astype(dt)
            ragged = jax.jit(lambda l, r, g: jax.lax.ragged_dot(l, r, g))
            ours = jax.jit(lambda l, r, g, mode=dt_name: fj.gmm(l, r, g, mode))
            t_r = best(lambda: ragged(lhs, rhs, gs).block_until_ready(), reps)
            ln, rn = np.asarray(lhs), np.asarray(rhs)
            out_dt = "float32" if dt_name == "f32" else "bfloat16"
            t_o, t_np = best_pair(lambda: ours(lhs, rhs, gs).block_until_ready(),
                                  lambda: fp8moe.gmm(ln, rn, gs_np, dt_name, out_dtype=out_dt),
                                  reps)
            rows.append(dict(shape=name, mode=dt_name, gflop=flops / 1e9,
                             ragged_dot_ms=t_r * 1e3, fp8moe_jax_ms=t_o * 1e3,
                             speedup=t_r / t_o, fp8moe_numpy_ms=t_np * 1e3,
                             jax_over_numpy=t_o / t_np,
                             fp8moe_gflops=flops / t_o / 1e9,
                             x_ceiling=(flops / t_o) / (flops / t_ceiling)))
            print_row(rows[-1])
        # The QAT forward: codes given, activation quantized inside the kernel.
        q, s = fp8moe.quantize(w32, "e4m3fn", "channel")
        qj, sj = jnp.asarray(q), jnp.asarray(s)
        lhs = jnp.asarray(a32).astype(jnp.bfloat16)
        native = jax.jit(lambda l, q, s, g: fj.gmm(l, q, g, "native_fp8", rhs_scale=s))
        t_o = best(lambda: native(lhs, qj, sj, gs).block_until_ready(), reps)
        t_r = next(r["ragged_dot_ms"] for r in rows if r["shape"] == name and r["mode"] == "bf16") / 1e3
        rows.append(dict(shape=name, mode="native_fp8", gflop=flops / 1e9,
                         ragged_dot_ms=t_r * 1e3, fp8moe_jax_ms=t_o * 1e3, speedup=t_r / t_o,
                         fp8moe_numpy_ms=float("nan"), jax_over_numpy=float("nan"),
                         fp8moe_gflops=flops / t_o / 1e9,
                         x_ceiling=(flops / t_o) / (flops / t_ceiling)))
        print_row(rows[-1])
        print(f"{'':14s} ceiling: numpy matmul [{valid}, {k}] x [{k}, {n}] f32 "
              f"{flops / t_ceiling / 1e9:.1f} GFLOP/s", flush=True)


def print_row(r):
    print(f"{r['shape']:14s} {r['mode']:>10s} {r['gflop']:7.2f} {r['ragged_dot_ms']:12.1f} "
          f"{r['fp8moe_jax_ms']:11.2f} {r['speedup']:8.1f}x {r['fp8moe_numpy_ms']:11.2f} "
          f"{r['jax_over_numpy']:8.2f} {r['fp8moe_gflops']:8.1f} {r['x_ceiling']:6.2f}", flush=True)


def bench_ffi(reps, calls):
    e, k, n = 2, 16, 16
    rng = np.random.default_rng(1)
    out = {}
    x = jnp.ones((8, 16), jnp.float32)
    noop = jax.jit(lambda a: a + 1)
    out["jit no-op (x + 1)"] = per_call_us(lambda: noop(x).block_until_ready(), calls, reps)
    w = jnp.asarray(rng.standard_normal((e, k, n)), jnp.float32)
    g = jax.jit(lambda l, r, gs: fj.gmm(l, r, gs, "f32"))
    l0, gs0 = jnp.zeros((0, k), jnp.float32), jnp.zeros((e,), jnp.int32)
    out["jit fp8moe.jax.gmm, 0 rows"] = per_call_us(lambda: g(l0, w, gs0).block_until_ready(),
                                                     calls, reps)
    l8, gs8 = jnp.asarray(rng.standard_normal((8, k)), jnp.float32), jnp.array([5, 3], jnp.int32)
    out["jit fp8moe.jax.gmm, 8 rows"] = per_call_us(lambda: g(l8, w, gs8).block_until_ready(),
                                                     calls, reps)
    ln, wn, gn = np.asarray(l8), np.asarray(w), np.asarray(gs8)
    out["fp8moe.gmm (numpy), 8 rows"] = per_call_us(lambda: fp8moe.gmm(ln, wn, gn, "f32"),
                                                     calls, reps)
    rd = jax.jit(lambda l, r, gs: jax.lax.ragged_dot(l, r, gs))
    out["jit ragged_dot, 8 rows"] = per_call_us(lambda: rd(l8, w, gs8).block_until_ready(),
                                                 calls, reps)
    out["FFI overhead (0 rows - no-op)"] = (out["jit fp8moe.jax.gmm, 0 rows"] -
                                            out["jit no-op (x + 1)"])
    for name, us in out.items():
        print(f"  {name:34s} {us:8.1f} us", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fp8moe.bench",
                                description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--shape", action="append", default=[],
                   help="substring of a shape name (repeatable); default: all")
    p.add_argument("--reps", type=int, default=3, help="runs per measurement (best kept)")
    p.add_argument("--calls", type=int, default=2000, help="calls per FFI overhead sample")
    p.add_argument("--ffi-only", action="store_true", help="only the FFI call cost")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    a = p.parse_args(argv)
    print(fp8moe.info(), f"| jax {jax.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")
    rows = []
    if not a.ffi_only:
        print(f"{'shape':14s} {'mode':>10s} {'GFLOP':>7s} {'ragged_dot ms':>12s} "
              f"{'fp8moe.jax ms':>11s} {'speedup':>9s} {'numpy ms':>11s} {'jax/np':>8s} "
              f"{'GFLOP/s':>8s} {'x ceil':>6s}")
        bench_shapes(a.shape, a.reps, rows)
    print("FFI call cost (per call, best of reps):")
    ffi = bench_ffi(a.reps, a.calls)
    if rows:
        worst = min(r["speedup"] for r in rows if r["mode"] in ("f32", "bf16"))
        print(f"slowest speedup over ragged_dot (f32, bf16): {worst:.1f}x (target >= 5x); "
              f"FFI overhead {ffi['FFI overhead (0 rows - no-op)']:.1f} us (target < 50 us)")
    if a.json:
        print(json.dumps({"shapes": rows, "ffi_us": ffi}, indent=1))


if __name__ == "__main__":
    main()
