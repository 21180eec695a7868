#!/usr/bin/env python3
"""A randomized campaign over every public function of `fp8moe` and
`fp8moe.jax` with hostile arguments: wrong dtypes and ranks, non-contiguous,
negative-stride, Fortran-order, unaligned, read-only and zero-size arrays
(also with 2^40 dimensions beside a zero), negative and overflowing group
sizes and integers, bad strings (unknown, empty, NUL, non-ASCII, long).

The contract (docs/python.md): each call returns or raises ValueError /
TypeError with a message (OverflowError for a Python int past the integer
type it is converted to), or MemoryError naming the bytes and the memory cap
for a request larger than the cap; in fp8moe.jax an error the FFI handler
finds when the computation runs can only surface as jax's JaxRuntimeError,
which must be INVALID_ARGUMENT (or RESOURCE_EXHAUSTED) carrying fp8moe's
message naming the function; anything else (another exception, an empty message) is printed as a
contract break and makes the exit code 1; a crash kills the process, which
the caller (tests/python/test_python_robustness.py) sees as a signal.

    python3 tests/python/python_campaign.py SEED CALLS [jax]

Before each call its description goes to stderr (flushed), so a crash names
the call that caused it.
"""
import random
import sys

import ml_dtypes
import numpy as np

import fp8moe

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz, np.int8,
          np.int32, np.int64, np.uint8, np.bool_, np.complex64, object]
STRINGS = ["e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "bf16", "int8", "f32", "bf16", "fake_qat",
           "native_fp8", "tensor", "row", "channel", "group_tile", "absmax", "fixed,-1,1",
           "fixed,nan,1", "fixed,1e39,1", "fixed,", "exact_divide", "xla_reciprocal", "swiglu",
           "dswiglu", "float32", "bfloat16", "", "nosuch", "e4m3fn\0x", "é" * 3, "x" * 10000,
           "none", "gather8"]
INTS = [0, 1, 2, 3, 7, 8, 128, 512, -1, -2**31, 2**31 - 1, 2**31, 2**62, 2**63 - 1, -2**63,
        2**64, 2**100, 1e8, float("nan"), 0.5, True, None]


def rand_shape(rng, rank=None):
    rank = rng.randrange(0, 5) if rank is None else rank
    shape = [rng.choice([0, 1, 2, 3, 4, 5, 8]) for _ in range(rank)]
    if rank and rng.random() < 0.1:  # an enormous dimension beside a zero
        shape[rng.randrange(rank)] = 0
        shape[rng.randrange(rank)] = 2**40 if 0 in shape else 0
    return tuple(shape)


def rand_array(rng, rank=None, dtype=None):
    shape = rand_shape(rng, rank)
    dtype = dtype or rng.choice(DTYPES)
    n = int(np.prod(shape)) if all(d < 2**20 for d in shape) else 0
    try:
        if dtype is object:
            a = np.empty(shape, dtype=object)
        elif np.dtype(dtype).kind in "fcV" or dtype in (ml_dtypes.bfloat16,):
            vals = rng.choice([0.0, 1.0, -1.0, 448.0, 1e30, float("inf"), float("nan"), 1e-30])
            a = np.full(shape, vals, dtype=np.float32).astype(dtype)
            if n and rng.random() < 0.7:
                a = (np.random.default_rng(rng.randrange(1 << 30)).standard_normal(shape)
                     .astype(np.float32).astype(dtype))
        else:
            a = np.zeros(shape, dtype=dtype)
    except (ValueError, MemoryError, OverflowError):
        a = np.zeros((2, 2), np.float32)
    kind = rng.random()
    if kind < 0.08 and a.ndim:
        a = a[::-1]                            # negative stride
    elif kind < 0.16 and a.ndim and a.shape[0] > 1:
        a = a[::2]                             # non-contiguous
    elif kind < 0.22 and a.ndim > 1:
        a = np.asfortranarray(a)
    elif kind < 0.28 and a.ndim:
        a = a.T
    elif kind < 0.32 and a.size and a.dtype != object:
        raw = np.zeros(a.nbytes + 1, np.uint8)[1:]  # unaligned
        a = raw.view(a.dtype).reshape(a.shape)
    elif kind < 0.36:
        a.setflags(write=False)
    return a


def group_sizes(rng, e=None):
    e = rng.choice([0, 1, 2, 3, 4]) if e is None else e
    gs = [rng.choice([0, 1, 2, 3, 4, -1, 2**31 - 1, -2**31]) for _ in range(e)]
    dtype = rng.choice([np.int32, np.int32, np.int32, np.int64, np.uint32, np.float32])
    with np.errstate(all="ignore"):
        try:
            return np.array(gs, dtype=dtype)
        except OverflowError:
            return np.array(gs, dtype=np.int64)


def anything(rng):
    r = rng.random()
    if r < 0.5:
        return rand_array(rng)
    if r < 0.6:
        return rng.choice(STRINGS)
    if r < 0.75:
        return rng.choice(INTS)
    if r < 0.85:
        return [[1.0, 2.0], [3.0]]  # ragged list
    return rng.choice([None, {}, object(), b"bytes", 1j])


def arg_or_bad(rng, good):
    return good if rng.random() < 0.7 else anything(rng)


def matrices(rng):
    """Mostly consistent (M, K, N, E) operands, one of them spoiled at random."""
    m, k, n, e = (rng.choice([0, 1, 2, 3, 4, 8]) for _ in range(4))
    dt = rng.choice([np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int8])
    lhs = rand_array(rng, 2, dt) if rng.random() < 0.3 else np.ones((m, k), dt)
    rhs = rand_array(rng, 3, dt) if rng.random() < 0.3 else np.ones((e, k, n), dt)
    gs = group_sizes(rng, e) if rng.random() < 0.5 else np.full(e, m // max(e, 1), np.int32)
    return lhs, rhs, gs, m, k, n, e


def call_core(rng):
    """(description, thunk) for one random call of the numpy API."""
    fn = rng.choice(["cast", "decode", "quantize", "dequantize", "gmm", "dlhs", "tgmm",
                     "moe_config", "moe_forward", "moe_backward", "set_num_threads", "info"])
    kw = {}
    if fn == "cast":
        args = [arg_or_bad(rng, rand_array(rng, dtype=np.float32)), arg_or_bad(rng, rng.choice(STRINGS))]
        kw = {"saturate": arg_or_bad(rng, rng.random() < 0.5)}
    elif fn == "decode":
        args = [rand_array(rng)]
    elif fn == "quantize":
        args = [arg_or_bad(rng, rand_array(rng, dtype=np.float32)), rng.choice(STRINGS),
                rng.choice(["tensor", "row", "channel", "group_tile"] + STRINGS[:3])]
        kw = {"block_size": rng.choice(INTS), "calibration": rng.choice(STRINGS),
              "scale_arithmetic": rng.choice(["exact_divide", "xla_reciprocal", "x"]),
              "valid_rows": rng.choice(INTS), "group_sizes": rng.choice([None, group_sizes(rng)]),
              "tile_m": rng.choice(INTS)}
        kw = {k: v for k, v in kw.items() if rng.random() < 0.5}
    elif fn == "dequantize":
        args = [rand_array(rng), rand_array(rng, dtype=np.float32),
                rng.choice(["tensor", "row", "channel", "group_tile", "bad"])]
        kw = {"block_size": rng.choice(INTS), "group_sizes": rng.choice([None, group_sizes(rng)]),
              "tile_m": rng.choice(INTS)}
        kw = {k: v for k, v in kw.items() if rng.random() < 0.5}
    elif fn in ("gmm", "dlhs", "tgmm"):
        lhs, rhs, gs, m, k, n, e = matrices(rng)
        mode = rng.choice(["f32", "bf16", "fake_qat", "native_fp8", "int8", "bad", ""])
        tiles = rng.choice([None, (None, None, None), (rng.choice(INTS), None, rng.choice(INTS)),
                            (1, 2), "abc", (2**63 - 1,) * 3])
        if fn == "gmm":
            args = [lhs, rhs, arg_or_bad(rng, gs), mode]
            kw = {"rhs_scale": rng.choice([None, rand_array(rng, 2, np.float32),
                                           np.ones((e, n), np.float32)]),
                  "epilogue": rng.choice([None, "swiglu", "x"]), "tiles": tiles,
                  "lhs_quant_block_size": rng.choice(INTS), "lhs_calibration": rng.choice(STRINGS),
                  "out_dtype": rng.choice(["float32", "bfloat16", "int8"]),
                  "return_h": rng.random() < 0.3, "reference": rng.random() < 0.3,
                  "fp8_dtype": rng.choice(STRINGS[:3])}
        elif fn == "dlhs":
            args = [np.ones((m, n), lhs.dtype), rhs, arg_or_bad(rng, gs), mode]
            kw = {"rhs_scale": rng.choice([None, np.ones((e, n), np.float32)]),
                  "h": rng.choice([None, rand_array(rng, 2)]), "tiles": tiles,
                  "epilogue": rng.choice([None, "dswiglu", "x"]), "reference": rng.random() < 0.3}
        else:
            args = [lhs, rand_array(rng, 2) if rng.random() < 0.3 else np.ones((m, n), lhs.dtype),
                    arg_or_bad(rng, gs), rng.choice(["f32", "bf16", "x"])]
            kw = {"dout_quant": rng.choice([None, "e5m2", "e4m3fn", "x"]),
                  "per_group": rng.random() < 0.5, "tiles": tiles, "calibration": rng.choice(STRINGS),
                  "reference": rng.random() < 0.3}
        kw = {k: v for k, v in kw.items() if rng.random() < 0.6}
    elif fn in ("moe_config", "moe_forward", "moe_backward"):
        flags = {}
        for _ in range(rng.randrange(0, 4)):
            flags[rng.choice(["num_experts", "num_experts_per_tok", "dtype", "quantization",
                              "ragged_buffer_factor", "wi_tile_fwd_batch_seq", "nosuch",
                              "fp8_moe_fake_quant", "norm_topk_prob", ""])] = anything(rng) \
                if rng.random() < 0.5 else rng.choice(INTS + STRINGS[:5])
        if fn == "moe_config":
            args = []
            kw = flags
        else:
            t, d, e, f = (rng.choice([0, 1, 2, 4]) for _ in range(4))
            flags.setdefault("num_experts", max(e, 1))
            base = [np.ones((t, d), np.float32), np.ones((d, e), np.float32),
                    np.ones((e, d, 2 * f), np.float32), np.ones((e, f, d), np.float32)]
            args = [arg_or_bad(rng, a) for a in base]
            if fn == "moe_backward":
                args.append(arg_or_bad(rng, np.ones((t, d), np.float32)))
                flags["daux"] = rng.choice([1.0, float("nan"), "x", 2**70])
            kw = flags
    elif fn == "set_num_threads":
        args = [rng.choice(INTS)]
    else:
        args = []
    desc = f"fp8moe.{fn}(" + ", ".join(describe(a) for a in args) + \
        "".join(f", {k}={describe(v)}" for k, v in kw.items()) + ")"
    f = getattr(fp8moe, fn)
    return desc, (lambda: f(*args, **kw))


def call_jax(rng):
    import jax.numpy as jnp

    import fp8moe.jax as fj
    fn = rng.choice(["quantize", "gmm", "dlhs", "tgmm", "moe"])
    lhs, rhs, gs, m, k, n, e = matrices(rng)
    if fn == "quantize":
        args = [arg_or_bad(rng, rand_array(rng, dtype=np.float32)), rng.choice(STRINGS),
                rng.choice(["tensor", "row", "channel", "group_tile", "x"])]
        kw = {"block_size": rng.choice(INTS)} if rng.random() < 0.3 else {}
    elif fn == "moe":
        t, d, e, f = (rng.choice([0, 1, 2, 4]) for _ in range(4))
        args = [arg_or_bad(rng, a) for a in (np.ones((t, d), np.float32), np.ones((d, e), np.float32),
                                             np.ones((e, d, 2 * f), np.float32),
                                             np.ones((e, f, d), np.float32))]
        kw = {"num_experts": rng.choice([max(e, 1), 0, -1, 2**40, "x"])}
    else:
        mode = rng.choice(["f32", "bf16", "fake_qat", "native_fp8", "x"])
        args = [lhs, rhs, arg_or_bad(rng, gs), mode]
        if fn == "dlhs":
            args[0] = np.ones((m, n), lhs.dtype)
        if fn == "tgmm":
            args[1] = np.ones((m, n), lhs.dtype)
            args[3] = rng.choice(["f32", "bf16", "x"])
        kw = {"tiles": rng.choice([None, (2**63 - 1, None, None), (0, 0, 0), "x"])} \
            if rng.random() < 0.4 else {}
    desc = f"fp8moe.jax.{fn}(" + ", ".join(describe(a) for a in args) + \
        "".join(f", {k}={describe(v)}" for k, v in kw.items()) + ")"
    f = getattr(fj, fn)

    def thunk():
        r = f(*[jnp.asarray(a) if isinstance(a, np.ndarray) and a.dtype != object
                and rng.random() < 0.5 else a for a in args], **kw)
        import jax
        jax.block_until_ready(r)
    return desc, thunk


def describe(a):
    if isinstance(a, np.ndarray):
        flags = "" if a.flags.c_contiguous else " non-contiguous"
        flags += "" if a.flags.aligned else " unaligned"
        flags += "" if a.flags.writeable else " read-only"
        return f"array({a.dtype}, {a.shape}, strides={a.strides}{flags})"
    r = repr(a)
    return r if len(r) < 60 else r[:57] + "..."


def main():
    seed, calls = int(sys.argv[1]), int(sys.argv[2])
    use_jax = len(sys.argv) > 3 and sys.argv[3] == "jax"
    rng = random.Random(seed)
    breaks = 0
    counts = {"ok": 0, "ValueError": 0, "TypeError": 0, "MemoryError": 0}
    for i in range(calls):
        desc, thunk = (call_jax if use_jax else call_core)(rng)
        print(f"call {i}: {desc}", file=sys.stderr, flush=True)
        try:
            thunk()
            counts["ok"] += 1
        except OverflowError as ex:  # a Python int past the dtype jax converts it to
            counts["OverflowError"] = counts.get("OverflowError", 0) + 1
            if not str(ex).strip():
                breaks += 1
                print(f"CONTRACT BREAK (empty message): {desc}: OverflowError", flush=True)
        except MemoryError as ex:
            counts["MemoryError"] += 1
            if "memory cap" not in str(ex):
                breaks += 1
                print(f"CONTRACT BREAK (MemoryError without the cap): {desc}: {ex}", flush=True)
        except (ValueError, TypeError) as ex:
            counts[type(ex).__name__ if type(ex).__name__ in counts else
                   ("ValueError" if isinstance(ex, ValueError) else "TypeError")] += 1
            if not str(ex).strip():
                breaks += 1
                print(f"CONTRACT BREAK (empty message): {desc}: {type(ex).__name__}", flush=True)
        except RuntimeError as ex:
            msg = str(ex)
            name = desc.split("(")[0].split(".")[-1]
            # XLA's own allocator refuses an output too large the same way.
            if (use_jax and type(ex).__name__ == "JaxRuntimeError" and
                    (msg.startswith("INVALID_ARGUMENT: ") and (name in msg or "moe" in name) or
                     msg.startswith("RESOURCE_EXHAUSTED: "))):
                counts["JaxRuntimeError"] = counts.get("JaxRuntimeError", 0) + 1
            else:
                breaks += 1
                print(f"CONTRACT BREAK: {desc}: {type(ex).__name__}: {msg[:300]}", flush=True)
        except Exception as ex:  # noqa: BLE001 - the point is to catch what escapes
            breaks += 1
            print(f"CONTRACT BREAK: {desc}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    print(f"campaign seed {seed}: {calls} calls, {counts}, {breaks} contract breaks", flush=True)
    return 1 if breaks else 0


if __name__ == "__main__":
    sys.exit(main())
