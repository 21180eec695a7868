#!/usr/bin/env python3
"""A random hostile campaign against `fp8moe op`: thousands of random requests
(every op, random dtypes, shapes with 0 and enormous dimensions, keys with
extreme integers and floats, unknown keys, missing and extra tensors), each
checked against the command's contract:

  exit 0 with a right answer, or exit 2 with an "error: ..." message;
  never a crash, a hang, a sanitizer report, exit 1 (no case here is an I/O
  failure) or a wrong answer.

"Right answer" oracles: cast and decode against ml_dtypes; gmm / dlhs / tgmm
fast against their reference twin (reference=true) within the f32
accumulation bound gamma_R * sum|a b| (sum|a b| from the reference run on
|inputs|), and bit-identical when only tile keys differ; moe_forward /
moe_backward bit-identical with and without tile keys.

    build/venv/bin/python tests/python/hostile_campaign.py --bin build/release/cli/fp8moe \
        --cases 3000 --seed 1 [--asan] [--save-failures DIR]

Prints a table of contract breaks by class and one reproducer per class. Not a
pytest module (its name does not start with test_): run it by hand before a
release or after changing validation. Runs one process at a time.
"""
import argparse
import collections
import json
import os
import pathlib
import random
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import st  # noqa: E402

BF16 = ml_dtypes.bfloat16
NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": BF16,
      "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
      "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
      "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
      "F8_E5M2": ml_dtypes.float8_e5m2,
      "e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "e5m2fnuz": ml_dtypes.float8_e5m2fnuz}
SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
        "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
        "e4m3fnuz": 1, "e5m2fnuz": 1}
ALL_DTYPES = list(SIZE)
FLOATISH = ["F32", "BF16", "F8_E4M3", "F8_E5M2", "e4m3fnuz", "e5m2fnuz", "I8", "U8", "I32"]
HUGE = [2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1]
EXTREME_INTS = ["9223372036854775807", "-9223372036854775808", "4611686018427387904",
                "100000000", "1048576", "1048577", "2147483648", "0", "-1", "-2", "1", "2",
                "3", "7", "128", "512", "65536", "99999999999999999999"]
EXTREME_FLOATS = ["1e18", "1e300", "-1e300", "1e-300", "0", "-0", "0.5", "1", "2", "1e6",
                  "inf", "nan", "-1", "1e308", "4.9e-324", "1.7976931348623157e308"]
TILE_KEYS = ["tile_m", "tile_k", "tile_n"]
MOE_TILE_KEYS = [f"{w}_tile_{p}_{d}" for w in ("wi", "wo") for p in ("fwd", "dlhs", "drhs")
                 for d in ("batch_seq", "embed_dim", "mlp_dim")]


# ---- writing arbitrary safetensors (any dtype, any shape) --------------------------------

class T:
    """A tensor as written: safetensors dtype name (or an fnuz format), shape, bytes."""

    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, list(shape), data


def nelem(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def write_file(path, tensors):
    header, meta, blobs, off = {}, {}, [], 0
    for name, t in tensors.items():
        dt = t.dtype
        if dt in ("e4m3fnuz", "e5m2fnuz"):
            meta[f"{name}.format"] = dt
            dt = "U8"
        header[name] = {"dtype": dt, "shape": t.shape, "data_offsets": [off, off + len(t.data)]}
        blobs.append(t.data)
        off += len(t.data)
    if meta:
        header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def values(rng, dtype, n, nice):
    """n elements of `dtype` as bytes: nice small values, or special ones."""
    if dtype == "BOOL":
        return bytes(rng.choice([0, 1]) for _ in range(n))
    if dtype in ("I32", "I64", "I16", "U16", "U32", "U64"):
        a = np.array([rng.choice([0, 1, 2, 3, 5, 7, 40, -1, 2**31 - 1]) if not nice
                      else rng.randint(0, 4) for _ in range(n)], np.int64)
        return a.astype(NP[dtype]).tobytes()
    if dtype in ("U8", "I8") and not nice:
        return bytes(rng.randrange(256) for _ in range(n))
    x = np.array([rng.gauss(0, 1) for _ in range(n)], np.float64)
    if not nice:
        special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3.4e38, -3.4e38, 1e30, 65504.0]
        for i in range(n):
            if rng.random() < 0.2:
                x[i] = rng.choice(special)
    if dtype in ("U8", "I8"):
        return np.clip(np.rint(x * 20), -127, 127).astype(np.int8).astype(NP[dtype]).tobytes()
    with np.errstate(all="ignore"):
        return x.astype(np.float32).astype(NP[dtype]).tobytes()


# ---- case generation --------------------------------------------------------------------

def rand_shape(rng, rank, small_max=6):
    return [rng.randint(1, small_max) for _ in range(rank)]


def hostile_shape(rng, shape):
    """Mutates a shape: a zero dimension, a zero beside an enormous one, off by one."""
    s = list(shape)
    if not s:
        return [rng.choice([0, 1, 2])]
    r = rng.random()
    i = rng.randrange(len(s))
    if r < 0.3:
        s[i] = 0
    elif r < 0.6 and len(s) >= 1:
        s[i] = 0
        j = rng.randrange(len(s))
        if j != i or len(s) == 1:
            if len(s) == 1:
                s = [0, rng.choice(HUGE)] if rng.random() < 0.5 else [rng.choice(HUGE), 0]
            else:
                s[j] = rng.choice(HUGE)
    elif r < 0.8:
        s[i] += rng.choice([-1, 1, 2])
        s[i] = max(s[i], 0)
    elif r < 0.9:
        s = s[:-1] if len(s) > 1 else s + [1]
    else:
        s = s + [rng.randint(1, 3)]
    return s


def make_tensor(rng, dtype, shape, nice=True):
    n = nelem(shape)
    if n > 1 << 16:  # keep files small: huge shapes must hold no elements
        shape = list(shape)
        shape[rng.randrange(len(shape))] = 0
        n = 0
    return T(dtype, shape, values(rng, dtype, n, nice))


def group_sizes(rng, e, m):
    left = m - rng.randint(0, min(m, 3))
    s = []
    for g in range(e):
        take = left if g == e - 1 else rng.randint(0, max(left, 0))
        if rng.random() < 0.25:
            take = 0
        take = max(0, min(take, left))
        s.append(take)
        left -= take
    return s


def base_case(rng, op):
    """A plausible request for `op`: (tensors, keys)."""
    nice = rng.random() < 0.8
    keys = {}
    if op == "cast":
        keys["format"] = rng.choice(["e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "bf16"])
        keys["saturate"] = rng.choice(["true", "false"])
        return {"x": make_tensor(rng, "F32", rand_shape(rng, rng.randint(0, 3)), nice)}, keys
    if op == "decode":
        dt = rng.choice(["F8_E4M3", "F8_E5M2", "e4m3fnuz", "e5m2fnuz", "BF16", "U8"])
        if dt == "U8" or rng.random() < 0.2:
            keys["format"] = rng.choice(["e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "bf16", ""])
        return {"y": make_tensor(rng, dt, rand_shape(rng, rng.randint(0, 3)), nice)}, keys
    if op in ("quantize", "dequantize"):
        gran = rng.choice(["tensor", "row", "channel"])
        keys["granularity"] = gran
        keys["dtype"] = rng.choice(["e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "int8"])
        if gran == "row" and rng.random() < 0.5:
            keys["block_size"] = rng.choice(["0", "128", "512"])
        if op == "quantize" and rng.random() < 0.3:
            keys["calibration"] = rng.choice(["absmax", "fixed,-2,2", "fixed,0,0", "fixed,1e38,1"])
        shape = rand_shape(rng, 3 if gran == "channel" else 2, 40)
        if op == "quantize":
            return {"x": make_tensor(rng, "F32", shape, nice)}, keys
        qdt = {"e4m3fn": "F8_E4M3", "e5m2": "F8_E5M2", "int8": "I8"}.get(keys["dtype"], keys["dtype"])
        if gran == "tensor":
            sshape = [1]
        elif gran == "row":
            b = int(keys.get("block_size", "0"))
            sshape = [shape[0], 1 if b == 0 else -(-shape[1] // b)]
        else:
            sshape = [shape[0], shape[2]]
        return {"q": make_tensor(rng, qdt, shape, nice),
                "scale": make_tensor(rng, "F32", sshape, True)}, keys
    if op in ("gmm", "dlhs", "tgmm"):
        modes = {"gmm": ["f32", "bf16", "fake_qat", "native_fp8", "int8"],
                 "dlhs": ["f32", "bf16", "fake_qat"], "tgmm": ["f32", "bf16"]}[op]
        mode = rng.choice(modes)
        keys["mode"] = mode
        e, m, k, n = rng.randint(1, 4), rng.randint(1, 24), rng.randint(1, 40), rng.randint(1, 24)
        gs = group_sizes(rng, e, m)
        t = {"group_sizes": T("I32", [e], np.array(gs, np.int32).tobytes())}
        fdt = "F32" if mode == "f32" else rng.choice(["F32", "BF16"])
        if op == "gmm":
            if rng.random() < 0.3:
                keys["epilogue"] = "swiglu"
                n += n % 2
            t["lhs"] = make_tensor(rng, fdt, [m, k], nice)
        elif op == "dlhs":
            t["dout"] = make_tensor(rng, fdt, [m, n], nice)
            if rng.random() < 0.3:
                keys["epilogue"] = "dswiglu"
                t["h"] = make_tensor(rng, rng.choice(["F32", "BF16"]), [m, 2 * k], nice)
        else:
            lhs_dt = fdt if rng.random() < 0.8 else rng.choice(["F8_E4M3", "F8_E5M2"])
            t["lhs"] = make_tensor(rng, lhs_dt, [m, k], nice)
            if rng.random() < 0.3:
                keys["dout_quant"] = rng.choice(["e5m2", "e4m3"])
                keys["dout_quant_granularity"] = rng.choice(["group", "tile"])
                t["dout"] = make_tensor(rng, "F32", [m, n], nice)
            else:
                t["dout"] = make_tensor(rng, fdt, [m, n], nice)
        if op != "tgmm":
            if mode in ("fake_qat", "native_fp8", "int8") and rng.random() < 0.5:
                cdt = {"int8": "I8"}.get(mode, rng.choice(["F8_E4M3", "e4m3fnuz", "F8_E5M2"]))
                if mode == "native_fp8":
                    fp8 = rng.choice(["e4m3fn", "e4m3fnuz"])
                    keys["fp8_dtype"] = fp8
                    cdt = {"e4m3fn": "F8_E4M3"}.get(fp8, fp8)
                t["rhs_codes"] = make_tensor(rng, cdt, [e, k, n], nice)
                t["rhs_scale"] = make_tensor(rng, "F32", [e, n], True)
            else:
                t["rhs"] = make_tensor(rng, "F32" if mode == "f32" else rng.choice(["F32", "BF16"]),
                                       [e, k, n], nice)
            if mode == "native_fp8" and rng.random() < 0.4:
                keys["lhs_quant_block_size"] = rng.choice(["0", "128", "512"])
        if rng.random() < 0.3:
            keys["out_dtype"] = "bf16"
        if rng.random() < 0.5:
            for tk in TILE_KEYS:
                if rng.random() < 0.5:
                    keys[tk] = str(rng.choice([1, 2, 4, 6, 8, 16, 64, 512]))
        return t, keys
    # moe_forward / moe_backward
    tt, d, f, e = rng.randint(1, 12), rng.randint(1, 12), rng.randint(1, 8), rng.randint(1, 4)
    keys["num_experts"] = str(e)
    keys["num_experts_per_tok"] = str(rng.randint(1, e))
    keys["dtype"] = rng.choice(["float32", "bfloat16"])
    mode = rng.random()
    if mode < 0.2:
        keys.update(fp8_moe_fake_quant="true")
    elif mode < 0.35:
        keys.update(fp8_moe_fake_quant="true", fp8_fake_quant_hoist="gather8",
                    fp8_moe_native_fwd="true")
    elif mode < 0.5:
        keys.update(quantization="fp8_full", use_qwix_quantization="true",
                    moe_bwd_inkernel_quant=rng.choice(["true", "false"]))
    elif mode < 0.6:
        keys.update(quantization=rng.choice(["int8", "fp8", "nanoo_fp8"]))
    if rng.random() < 0.3:
        keys["ragged_buffer_factor"] = rng.choice(["0.5", "1", "2", "-1", "0.01"])
    if rng.random() < 0.3:
        for tk in rng.sample(MOE_TILE_KEYS, 3):
            keys[tk] = str(rng.choice([2, 4, 8, 16, 64]))
    t = {"x": make_tensor(rng, "F32", [tt, d], nice),
         "router": make_tensor(rng, "F32", [d, e], True),
         "wi": make_tensor(rng, "F32", [e, d, 2 * f], True),
         "wo": make_tensor(rng, "F32", [e, f, d], True)}
    if op == "moe_backward":
        t["dy"] = make_tensor(rng, "F32", [tt, d], nice)
    return t, keys


OPS = ["cast", "decode", "quantize", "dequantize", "gmm", "dlhs", "tgmm", "moe_forward",
       "moe_backward"]
INT_KEYS = {"block_size", "lhs_quant_block_size", "num_experts", "num_experts_per_tok",
            "moe_lhs_quant_block_size", "ici_tensor_parallelism", *TILE_KEYS, *MOE_TILE_KEYS}
FLOAT_KEYS = {"ragged_buffer_factor", "load_balance_loss_weight", "capacity_factor"}


def mutate(rng, op, tensors, keys):
    """0-3 hostile mutations of a plausible case."""
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        r = rng.random()
        names = list(tensors)
        if r < 0.25 and names:  # hostile shape
            nm = rng.choice(names)
            t = tensors[nm]
            tensors[nm] = make_tensor(rng, t.dtype, hostile_shape(rng, t.shape),
                                      rng.random() < 0.5)
        elif r < 0.4 and names:  # wrong dtype
            nm = rng.choice(names)
            t = tensors[nm]
            tensors[nm] = make_tensor(rng, rng.choice(ALL_DTYPES), t.shape, rng.random() < 0.5)
        elif r < 0.47 and names:  # missing tensor
            del tensors[rng.choice(names)]
        elif r < 0.52:  # extra tensor
            nm = rng.choice(["h", "rhs", "rhs_codes", "rhs_scale", "extra", "dy", "x", "y"])
            tensors[nm] = make_tensor(rng, rng.choice(FLOATISH),
                                      rand_shape(rng, rng.randint(1, 3)), rng.random() < 0.5)
        elif r < 0.75:  # extreme int key
            k = rng.choice(sorted(INT_KEYS))
            keys[k] = rng.choice(EXTREME_INTS)
        elif r < 0.85:  # extreme float key
            k = rng.choice(sorted(FLOAT_KEYS))
            keys[k] = rng.choice(EXTREME_FLOATS)
        elif r < 0.9:  # unknown / malformed key
            keys[rng.choice(["tile_x", "modee", "", "check_finit", "=", "x y"])] = "1"
        elif r < 0.95:  # bad string values
            k = rng.choice(["mode", "format", "dtype", "granularity", "calibration", "epilogue",
                            "out_dtype", "fp8_dtype", "quantization", "remat_policy",
                            "dout_quant", "saturate", "reference"])
            keys[k] = rng.choice(["", "x", "fixed,1,", "fixed,nan,1", "fixed,1e39,1", "TRUE",
                                  "e4m3", "bf16", "true"])
        else:  # everything random
            tensors.clear()
            for _ in range(rng.randint(0, 4)):
                nm = rng.choice(["x", "y", "q", "scale", "lhs", "rhs", "dout", "group_sizes",
                                 "router", "wi", "wo", "dy", "h"])
                tensors[nm] = make_tensor(rng, rng.choice(ALL_DTYPES),
                                          hostile_shape(rng, rand_shape(rng, rng.randint(0, 4))),
                                          rng.random() < 0.5)
    return tensors, keys


# ---- running and judging -----------------------------------------------------------------

class Runner:
    def __init__(self, binary, asan, timeout, workdir):
        self.bin, self.asan, self.timeout, self.dir = binary, asan, timeout, workdir
        self.env = dict(os.environ, OMP_NUM_THREADS="2")
        if asan:
            self.env["ASAN_OPTIONS"] = ("allocator_may_return_null=1:max_allocation_size_mb=6144:"
                                        "detect_leaks=1:abort_on_error=0")
            self.env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"

    def limit(self):
        if not self.asan:  # ASan reserves terabytes of address space for its shadow
            resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    def run(self, op, tensors, keys, tag="a"):
        src, dst = self.dir / f"in_{tag}.safetensors", self.dir / f"out_{tag}.safetensors"
        write_file(src, tensors)
        if dst.exists():
            dst.unlink()
        args = [self.bin, "op", op, "--in", str(src), "--out", str(dst)]
        args += [f"{k}={v}" if k not in ("=",) else "=" for k, v in keys.items()]
        t0 = time.time()
        try:
            p = subprocess.run(args, capture_output=True, text=True, timeout=self.timeout,
                               env=self.env, preexec_fn=self.limit)
        except subprocess.TimeoutExpired:
            return "hang", None, "", args
        dt = time.time() - t0
        err = p.stderr
        # allocator_may_return_null=1 makes ASan warn about a refused huge
        # allocation and return null, as malloc would: judged by what follows.
        findings = "\n".join(line for line in err.splitlines()
                              if "AddressSanitizer failed to allocate" not in line)
        if "Sanitizer" in findings or "runtime error:" in findings:
            return "sanitizer", None, err, args
        err = findings
        if p.returncode < 0 or p.returncode > 2:
            return "crash", None, err + f"\n(rc {p.returncode})", args
        if p.returncode == 1:
            return "exit1", None, err, args
        if p.returncode == 2:
            if not err.startswith("error") or dst.exists():
                return "bad_exit2", None, err, args
            return "exit2", None, err, args
        try:
            out = st.read(dst)
        except ValueError as ex:
            if "too big" in str(ex):  # numpy cannot hold [2^62, 0]-like shapes; fp8moe can
                return "ok", {}, "output not judged (numpy limit)", args
            return "bad_output_file", None, str(ex), args
        except Exception as ex:  # noqa: BLE001
            return "bad_output_file", None, str(ex), args
        return "ok", out, f"{dt:.2f}s", args


def decoded(t):
    """The float64 values of an input tensor as the op would read them."""
    return np.frombuffer(t.data, NP[t.dtype]).astype(np.float64).reshape(t.shape)


def check_cast(tensors, keys, out):
    x = np.frombuffer(tensors["x"].data, np.float32).reshape(tensors["x"].shape)
    fmt = keys.get("format", "e4m3fn")
    target = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
              "e5m2": ml_dtypes.float8_e5m2, "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
              "bf16": BF16}[fmt]
    if keys.get("saturate") == "true":
        mx = float(ml_dtypes.finfo(target).max)
        x = np.where(np.isnan(x), x, np.clip(x, -mx, mx)).astype(np.float32)
    with np.errstate(all="ignore"):
        want = x.astype(target)
    y = out.get("y")
    if y is None or y.shape != want.shape or y.dtype != want.dtype:
        return f"cast: output {None if y is None else (y.shape, y.dtype)} != {want.shape, want.dtype}"
    if y.tobytes() != want.tobytes():
        return "cast: bits differ from ml_dtypes"
    return None


def check_decode(tensors, keys, out):
    t = tensors["y"]
    fmt = {"F8_E4M3": "e4m3fn", "F8_E5M2": "e5m2", "BF16": "bf16"}.get(t.dtype, t.dtype)
    if fmt == "U8":
        fmt = keys.get("format")
    src = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
           "e5m2": ml_dtypes.float8_e5m2, "e5m2fnuz": ml_dtypes.float8_e5m2fnuz, "bf16": BF16}[fmt]
    if len(t.data) != nelem(t.shape) * np.dtype(src).itemsize:
        return f"decode: accepted {t.dtype} {t.shape} as {fmt} (byte widths differ)"
    want = np.frombuffer(t.data, src).astype(np.float32).reshape(t.shape)
    x = out.get("x")
    if x is None or x.shape != want.shape or x.tobytes() != want.tobytes():
        return "decode: differs from ml_dtypes"
    return None


def gamma(r):
    u = 2.0**-24
    return r * u / (1 - r * u) + 4 * u if r * u < 0.5 else np.inf


def abs_tensors(tensors):
    out = {}
    for nm, t in tensors.items():
        if nm in ("group_sizes", "h"):
            out[nm] = t
            continue
        raw = bytearray(t.data)
        if t.dtype in ("F32",):
            a = np.frombuffer(bytes(raw), np.uint32) & np.uint32(0x7FFFFFFF)
            raw = bytearray(a.tobytes())
        elif t.dtype == "BF16":
            a = np.frombuffer(bytes(raw), np.uint16) & np.uint16(0x7FFF)
            raw = bytearray(a.tobytes())
        elif t.dtype in ("F8_E4M3", "F8_E5M2"):
            raw = bytearray(b & 0x7F for b in raw)
        elif t.dtype in ("e4m3fnuz", "e5m2fnuz"):
            raw = bytearray(b if b == 0x80 else b & 0x7F for b in raw)
        elif t.dtype == "I8":
            a = np.abs(np.frombuffer(bytes(raw), np.int8).astype(np.int16))
            raw = bytearray(np.minimum(a, 127).astype(np.int8).tobytes())
        out[nm] = T(t.dtype, t.shape, bytes(raw))
    return out


def f64(a):
    return np.asarray(a).astype(np.float64)


# The fast SwiGLU is wrong for gates below about -177 (silu(g) comes out as g;
# the kernels' issue, which issue 9 leaves to it): such gates are not compared.
KNOWN_BAD_GATE = -170.0


def schedule_tile_keys(op, keys):
    """Tile keys that must not change the bits: all of them, except TGMM's m
    tile when it is the in-kernel quantization tile (and the MoE drhs
    batch_seq tiles with moe_bwd_inkernel_quant=true)."""
    tiles = TILE_KEYS if op in ("gmm", "dlhs", "tgmm") else MOE_TILE_KEYS
    out = [k for k in tiles if k in keys]
    if op == "tgmm" and keys.get("dout_quant", "none") != "none" and \
            keys.get("dout_quant_granularity", "group") == "tile":
        out = [k for k in out if k != "tile_m"]
    if op.startswith("moe") and keys.get("moe_bwd_inkernel_quant") == "true":
        out = [k for k in out if k not in ("wi_tile_drhs_batch_seq", "wo_tile_drhs_batch_seq")]
    return out


def check_gmm_family(runner, op, tensors, keys, out):
    """Fast vs reference within the f32 accumulation bound; tiles never change bits."""
    name = {"gmm": "out", "dlhs": "dlhs", "tgmm": "drhs"}[op]
    flip = dict(keys, reference="false" if keys.get("reference") == "true" else "true")
    status, other, err, _ = runner.run(op, tensors, flip, "ref")
    if status != "ok":
        return f"{op}: reference={flip['reference']} gives {status} but the other path runs: {err[:200]}"
    fast, ref = (out, other) if keys.get("reference") != "true" else (other, out)
    for nm in ref:
        if nm not in fast or fast[nm].shape != ref[nm].shape or fast[nm].dtype != ref[nm].dtype:
            return f"{op}: output '{nm}' {ref[nm].shape} (ref) vs {fast.get(nm, np.zeros(0)).shape} (fast)"
    sched = schedule_tile_keys(op, keys)
    if sched:
        plain = {k: v for k, v in keys.items() if k not in sched}
        status, untiled, err, _ = runner.run(op, tensors, plain, "untiled")
        if status != "ok":
            return f"{op}: without tile keys {status}: {err[:200]}"
        for nm in out:
            if not same_bits(out[nm], untiled[nm]):
                return f"{op}: tile keys changed the bits of '{nm}'"
    ep = keys.get("epilogue", "none")
    abs_keys = dict(keys, reference="true", out_dtype="f32", epilogue="none")
    abs_t = abs_tensors(tensors)
    if ep == "dswiglu":
        abs_t.pop("h", None)
    status, habs, err, _ = runner.run(op, abs_t, abs_keys, "abs")
    if status != "ok":
        return None  # e.g. |x| overflows a scale; nothing to compare against
    habs = f64(habs[name])
    if op == "gmm":
        r = tensors["lhs"].shape[1] if len(tensors["lhs"].shape) == 2 else 0
    elif op == "dlhs":
        r = tensors["dout"].shape[1]
    else:
        r = tensors["lhs"].shape[0]
    bound = gamma(r) * habs + 1e-30
    bf16 = keys.get("out_dtype") == "bf16"
    with np.errstate(all="ignore"):
        if ep == "none" or op == "tgmm":
            return compare(op, name, f64(fast[name]), f64(ref[name]), bound, bf16)
        if ep == "swiglu":
            msg = compare(op, "h", f64(fast["h"]), f64(ref["h"]), bound, bf16)
            if msg:
                return msg
            h = f64(ref["h"])
            f = h.shape[1] // 2
            g, u = h[:, :f], h[:, f:]
            eg, eu = bound[:, :f], bound[:, f:]
            s = 1 / (1 + np.exp(-g))
            ds = np.abs(s * (1 + g * (1 - s)))
            v = np.abs(g * s * u)
            b = ds * np.abs(u) * eg + np.abs(g * s) * eu + 1e-5 * v + 1e-30
            b = np.where(g < KNOWN_BAD_GATE, np.inf, b)
            return compare(op, "out", f64(fast["out"]), f64(ref["out"]), b, bf16)
        # dswiglu: da from the reference without the epilogue
        status, da, err, _ = runner.run(op, {k: v for k, v in tensors.items() if k != "h"},
                                        dict(keys, reference="true", epilogue="none",
                                             out_dtype="f32"), "da")
        if status != "ok":
            return f"dlhs: epilogue none fails ({status}) where dswiglu runs"
        a = f64(da["dlhs"])
        h = decoded(tensors["h"])
        k = a.shape[1]
        g, u = h[:, :k], h[:, k:]
        s = 1 / (1 + np.exp(-g))
        ds = s * (1 + g * (1 - s))
        b0 = np.abs(u * ds) * bound + 1e-5 * np.abs(a) * np.abs(u) * (1 + np.abs(g)) + 1e-30
        b1 = np.abs(g * s) * bound + 1e-5 * np.abs(a) * np.abs(g) + 1e-30
        b0 = np.where(g < KNOWN_BAD_GATE, np.inf, b0)
        b1 = np.where(g < KNOWN_BAD_GATE, np.inf, b1)
        return compare(op, name, f64(fast[name]), f64(ref[name]), np.concatenate([b0, b1], 1), bf16)


def compare(op, nm, fast, ref, bound, bf16):
    if fast.shape != ref.shape:
        return f"{op}: '{nm}' shapes {fast.shape} vs {ref.shape}"
    if bf16:
        bound = bound * 2 + np.abs(ref) * 2.0**-7
    # Compared where the bound is finite and the result is not near the f32
    # overflow threshold (where one side may round to FLT_MAX, the other to inf).
    ok_region = np.isfinite(bound) & (bound < 1e37) & (np.abs(ref) < 1e38)
    diff = np.abs(fast - ref)
    bad = ok_region & ~(diff <= bound) & ~(fast == ref)
    if bad.any():
        i = np.argwhere(bad)[0]
        return (f"{op}: '{nm}' fast {fast[tuple(i)]!r} vs reference {ref[tuple(i)]!r} at {i.tolist()}"
                f" beyond bound {bound[tuple(i)]:.3g}")
    return None


def same_bits(a, b):
    """Bit-identical, except that any NaN equals any NaN (payloads and signs
    follow the order operations meet them, which the contract leaves open)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.tobytes() == b.tobytes():
        return True
    if a.dtype.kind != "f" and a.dtype != BF16:
        return False
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    both_nan = np.isnan(fa) & np.isnan(fb)
    return bool(np.all((a.view(np.uint8).reshape(a.shape + (-1,)) ==
                        b.view(np.uint8).reshape(b.shape + (-1,))).all(-1) | both_nan))


def check_moe(runner, op, tensors, keys, out):
    sched = schedule_tile_keys(op, keys)
    if not sched:
        return None
    plain = {k: v for k, v in keys.items() if k not in sched}
    status, other, err, _ = runner.run(op, tensors, plain, "untiled")
    if status != "ok":
        return f"{op}: without tile keys {status}: {err[:200]}"
    for nm in out:
        if not same_bits(out[nm], other[nm]):
            return f"{op}: tile keys changed the bits of '{nm}'"
    return None


def judge(runner, op, tensors, keys):
    status, out, err, args = runner.run(op, tensors, keys)
    if status != "ok":
        return status, err, args
    try:
        if op == "cast":
            msg = check_cast(tensors, keys, out)
        elif op == "decode":
            msg = check_decode(tensors, keys, out)
        elif op in ("gmm", "dlhs", "tgmm"):
            msg = check_gmm_family(runner, op, tensors, keys, out)
        elif op.startswith("moe"):
            msg = check_moe(runner, op, tensors, keys, out)
        else:
            msg = None
    except Exception as ex:  # noqa: BLE001  (an oracle that cannot judge is not a break)
        return "ok", f"oracle skipped: {ex!r}", args
    if msg:
        return "wrong_answer", msg, args
    return "ok", "", args


BREAKS = {"hang", "sanitizer", "crash", "exit1", "bad_exit2", "bad_output_file", "wrong_answer"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--asan", action="store_true", help="the binary is an ASan + UBSan build")
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--save-failures", default=None, help="copy each break's input here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    timeout = args.timeout or (60.0 if args.asan else 15.0)
    work = pathlib.Path(tempfile.mkdtemp(prefix="hostile_"))
    runner = Runner(args.bin, args.asan, timeout, work)
    counts, examples = collections.Counter(), {}
    t0 = time.time()
    for i in range(args.cases):
        op = rng.choice(OPS)
        tensors, keys = base_case(rng, op)
        tensors, keys = mutate(rng, op, tensors, keys)
        status, msg, argv = judge(runner, op, tensors, keys)
        counts[status] += 1
        if status in BREAKS:
            cls = (status, op, msg.strip().splitlines()[0][:90] if msg else "")
            key = (status, op)
            if key not in examples:
                examples[key] = (msg, argv, {n: (t.dtype, t.shape) for n, t in tensors.items()})
                if args.save_failures:
                    d = pathlib.Path(args.save_failures)
                    d.mkdir(parents=True, exist_ok=True)
                    shutil.copy(work / "in_a.safetensors", d / f"{status}_{op}_{i}.safetensors")
                    (d / f"{status}_{op}_{i}.txt").write_text(" ".join(argv[:3] + argv[7:]) + "\n"
                                                              + (msg or ""))
            print(f"[{i}] BREAK {cls}", flush=True)
        if (i + 1) % 250 == 0:
            print(f"... {i + 1} cases, {time.time() - t0:.0f} s, {dict(counts)}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    broken = sum(v for k, v in counts.items() if k in BREAKS)
    print(f"\n{args.cases} cases in {time.time() - t0:.0f} s: {dict(counts)}")
    print(f"contract breaks: {broken} ({100.0 * broken / max(args.cases, 1):.2f}%)")
    for (status, op), (msg, argv, shapes) in sorted(examples.items()):
        print(f"\n== {status} in {op}: {' '.join(argv[7:])}\n   tensors: {shapes}\n   {msg[:600]}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
