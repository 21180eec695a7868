"""Hostile requests through `fp8moe op` (and `bench`): the exact reproducers
of issue 9 and their siblings, each class checked against the contract:
exit 0 with the right answer, or exit 2 with a message that names what is
wrong; never a crash, a hang (every run has a timeout), exit 1 or a wrong
answer. Also the memory cap, check_finite, concurrent writers of one --out
and SIGINT / SIGTERM during a run. docs/robustness.md lists them all.
"""
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import st

TIMEOUT = 60  # seconds; the hangs this file guards against never returned
I64_MAX = 2**63 - 1


def raw_file(path, entries, metadata=None, prefix=b""):
    """A safetensors file of any dtype and shape: name -> (dtype, shape, bytes)."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if metadata:
        header["__metadata__"] = metadata
    text = prefix + json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.fixture
def op(fp8moe_bin, tmp_path):
    """Runs `fp8moe [global args] op NAME` on a file written by `make(path)`;
    returns (exit code, outputs or None, stderr)."""

    def run(name, make, *keys, env=None, pre=()):
        src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
        make(src)
        if dst.exists():
            dst.unlink()
        p = subprocess.run([fp8moe_bin, *pre, "op", name, "--in", str(src), "--out", str(dst),
                            *keys], capture_output=True, text=True, timeout=TIMEOUT,
                           env=None if env is None else dict(os.environ, **env))
        assert p.returncode in (0, 2), (p.returncode, p.stderr)
        if p.returncode == 2:
            assert p.stderr.startswith("error"), p.stderr
            assert not dst.exists(), "a failed op wrote its output"
        return p.returncode, st.read(dst) if p.returncode == 0 else None, p.stderr

    return run


def arrays(**tensors):
    return lambda path: st.write(path, tensors)


def raw(entries, **kw):
    return lambda path: raw_file(path, entries, **kw)


# ---- 1. dtype / format byte widths -------------------------------------------------------

def test_decode_u8_as_bf16_is_refused(op):
    # Issue 9.1: read as 2-byte values it ran past the tensor (ASan) and wrote
    # heap bytes into the output (release).
    code, _, err = op("decode", raw({"y": ("U8", [200], b"\x3f" * 200)}), "format=bf16")
    assert code == 2 and "format=bf16" in err and "2-byte" in err and "uint8" in err, err


@pytest.mark.parametrize("dtype,fmt", [("U8", "e4m3fn"), ("U8", "e5m2fnuz"), ("BF16", "")])
def test_decode_matching_widths_still_work(op, dtype, fmt):
    data = bytes(range(64)) * 2
    code, out, err = op("decode", raw({"y": (dtype, [len(data) // (2 if dtype == "BF16" else 1)],
                                             data)}), *([f"format={fmt}"] if fmt else []))
    assert code == 0, err
    src = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
           "": ml_dtypes.bfloat16}[fmt]
    want = np.frombuffer(data, src).astype(np.float32)
    assert out["x"].tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3"])
def test_decode_dtype_and_format_must_agree(op, dtype):
    code, _, err = op("decode", raw({"y": (dtype, [2], b"\0" * (4 if dtype == "BF16" else 2))}),
                      "format=e5m2")
    assert code == 2 and "format=e5m2" in err, err


# ---- 2. tile sizes -----------------------------------------------------------------------

def gmm_tiny():
    return arrays(lhs=np.array([[1], [1]], np.float32),
                  rhs=np.array([[[1]], [[2]]], np.float32),
                  group_sizes=np.array([1, 1], np.int32))


@pytest.mark.parametrize("opname,key", [("gmm", "tile_m"), ("gmm", "tile_k"), ("gmm", "tile_n"),
                                        ("dlhs", "tile_m"), ("tgmm", "tile_m"), ("tgmm", "tile_k")])
@pytest.mark.parametrize("value", [I64_MAX, 4611686018427387904, 100000000, 1048578])
def test_tiles_past_the_bound_are_refused(op, opname, key, value):
    # Issue 9.2: tile_m=2^63-1 returned [2, 2] for [1, 2] (RowGroupItems),
    # tile_k=2^62 aborted with a double free, tgmm tile_m=2^63-1 segfaulted,
    # tile_k=1e8 failed with a confusing allocation error.
    make = gmm_tiny() if opname != "dlhs" else arrays(
        dout=np.ones((2, 1), np.float32), rhs=np.array([[[1]], [[2]]], np.float32),
        group_sizes=np.array([1, 1], np.int32))
    if opname == "tgmm":
        make = arrays(lhs=np.ones((2, 1), np.float32), dout=np.ones((2, 1), np.float32),
                      group_sizes=np.array([1, 1], np.int32))
    code, _, err = op(opname, make, "mode=f32", f"{key}={value}")
    assert code == 2 and key in err and "1048576" in err, err


def test_largest_tiles_give_the_right_answer(op):
    code, out, err = op("gmm", gmm_tiny(), "mode=f32", "tile_m=1048576", "tile_k=1048576",
                        "tile_n=1048576")
    assert code == 0, err
    assert out["out"].tolist() == [[1.0], [2.0]]
    code, out, err = op("tgmm", arrays(lhs=np.ones((3, 2), np.float32),
                                       dout=np.full((3, 2), 2, np.float32),
                                       group_sizes=np.array([1, 2], np.int32)),
                        "mode=f32", "dout_quant=e5m2", "dout_quant_granularity=tile",
                        "tile_m=1048576")
    assert code == 0, err
    assert out["drhs"].tolist() == [[[2, 2], [2, 2]], [[4, 4], [4, 4]]]


def moe_inputs(t=6, d=8, f=4, e=2, seed=0):
    rng = np.random.default_rng(seed)
    return dict(x=rng.standard_normal((t, d)).astype(np.float32),
                router=rng.standard_normal((d, e)).astype(np.float32),
                wi=(rng.standard_normal((e, d, 2 * f)) / 3).astype(np.float32),
                wo=(rng.standard_normal((e, f, d)) / 2).astype(np.float32),
                dy=rng.standard_normal((t, d)).astype(np.float32))


@pytest.mark.parametrize("flag", ["wi_tile_fwd_batch_seq", "wo_tile_drhs_mlp_dim",
                                  "wi_tile_dlhs_embed_dim"])
def test_moe_tile_flags_are_bounded(op, flag):
    # Issue 9.2: wi_tile_fwd_batch_seq=2^63-1 passed the validator and changed y.
    code, _, err = op("moe_forward", arrays(**moe_inputs()), "num_experts=2",
                      f"{flag}={I64_MAX}")
    assert code == 2 and flag in err and "1048576" in err, err
    code, base, err = op("moe_backward", arrays(**moe_inputs()), "num_experts=2")
    assert code == 0, err
    code, big, err = op("moe_backward", arrays(**moe_inputs()), "num_experts=2", f"{flag}=1048576")
    assert code == 0, err
    for name in base:
        assert base[name].tobytes() == big[name].tobytes(), name


# ---- 3. zero-element tensors with enormous dimensions ------------------------------------

def test_quantize_channel_zero_width_huge_height_returns(op):
    # Issue 9.3: x F32 [2^40, 0] (a 200-byte file) never returned.
    code, out, err = op("quantize", raw({"x": ("F32", [2**40, 0], b"")}), "granularity=channel")
    assert code == 0, err
    assert out["q"].shape == (2**40, 0) and out["scale"].shape == (1, 0)


def test_quantize_row_blocks_zero_width_huge_height_returns(op):
    code, out, err = op("quantize", raw({"x": ("F32", [2**40, 0], b"")}), "granularity=row",
                        "block_size=128")
    assert code == 0, err
    assert out["scale"].shape == (2**40, 0)


def test_quantize_row_zero_width_needs_a_scale_per_row(op):
    # One scale per row of [2^40, 0] is 4 TiB: refused up front, exit 2.
    code, _, err = op("quantize", raw({"x": ("F32", [2**40, 0], b"")}), "granularity=row")
    assert code == 2 and "'scale'" in err and "memory cap" in err, err


def test_u8_codes_without_a_format_say_how_to_name_fnuz(op):
    t = {"lhs": np.ones((2, 4), np.float32), "rhs_codes": np.zeros((1, 4, 3), np.uint8),
         "rhs_scale": np.ones((1, 3), np.float32), "group_sizes": np.array([2], np.int32)}
    code, _, err = op("gmm", arrays(**t), "mode=native_fp8", "fp8_dtype=e4m3fnuz")
    assert code == 2 and '"rhs_codes.format": "e4m3fnuz"' in err, err


def test_dequantize_checks_the_calibration_keys_it_accepts(op):
    """dequantize takes quantize's calibration keys (the scales already hold
    them) but did not check them: calibration=garbage passed."""
    t = {"q": np.zeros((2, 3), ml_dtypes.float8_e4m3fn), "scale": np.ones((2, 1), np.float32)}
    code, _, err = op("dequantize", arrays(**t), "granularity=row", "calibration=garbage")
    assert code == 2 and "unknown calibration 'garbage'" in err, err
    code, out, err = op("dequantize", arrays(**t), "granularity=row", "calibration=fixed,-1,1",
                        "scale_arithmetic=xla_reciprocal")
    assert code == 0 and (out["x"] == 0).all(), err


def test_dequantize_zero_width_huge_height_returns(op):
    code, out, err = op("dequantize", raw({"q": ("F8_E4M3", [1, 2**40, 0], b""),
                                           "scale": ("F32", [1, 0], b"")}),
                        "granularity=channel")
    assert code == 0 and out["x"].shape == (1, 2**40, 0), err


def test_gmm_fake_qat_empty_with_huge_k_returns(op):
    # Issue 9.3: lhs BF16 [0, 2^40], rhs [1, 2^40, 0] never returned.
    code, out, err = op("gmm", raw({"lhs": ("BF16", [0, 2**40], b""),
                                    "rhs": ("BF16", [1, 2**40, 0], b""),
                                    "group_sizes": ("I32", [1], b"\0" * 4)}), "mode=fake_qat")
    assert code == 0, err
    assert out["out"].shape == (0, 0)


@pytest.mark.parametrize("reference", ["false", "true"])
def test_tgmm_empty_with_huge_k_returns(op, reference):
    code, out, err = op("tgmm", raw({"lhs": ("BF16", [0, 2**40], b""),
                                     "dout": ("BF16", [0, 0], b""),
                                     "group_sizes": ("I32", [1], b"\0" * 4)}),
                        f"reference={reference}")
    assert code == 0 and out["drhs"].shape == (1, 2**40, 0), err


def test_tgmm_lhs_with_dimension_past_the_limit_is_refused(op):
    # Issue 9.3: lhs [0, 2^62] hung. Its nonzero dimension alone needs 2^63
    # bytes, so the shape is refused when the file is read (tensor.h's rule).
    code, _, err = op("tgmm", raw({"lhs": ("BF16", [0, 2**62], b""),
                                   "dout": ("BF16", [0, 4], b""),
                                   "group_sizes": ("I32", [1], b"\0" * 4)}))
    assert code == 2 and '"lhs"' in err and "nonzero dimensions" in err, err


def test_gmm_tall_zero_width_rows_return(op):
    # 2^31 - 1 valid rows of width 0 with one row per tile: bounded by the
    # (empty) output, not by the rows.
    code, out, err = op("gmm", raw({"lhs": ("F32", [2**40, 0], b""),
                                    "rhs": ("F32", [1, 0, 0], b""),
                                    "group_sizes": ("I32", [1], struct.pack("<i", 2**31 - 1))}),
                        "mode=f32", "tile_m=1")
    assert code == 0 and out["out"].shape == (2**40, 0), err


# ---- 4. exit codes: requests too large to serve ------------------------------------------

def test_gmm_output_too_large_is_exit_2_with_bytes_and_cap(op):
    # Issue 9.4: "resource exhausted" exited 1.
    code, _, err = op("gmm", raw({"lhs": ("F32", [2**40, 0], b""), "rhs": ("F32", [1, 0, 1], b""),
                                  "group_sizes": ("I32", [1], b"\0" * 4)}), "mode=f32")
    assert code == 2, err
    assert "output 'out'" in err and "4398046511104 bytes" in err and "memory cap" in err, err


def test_tgmm_petabyte_output_is_exit_2(op):
    code, _, err = op("tgmm", raw({"lhs": ("F32", [0, 2**30], b""),
                                   "dout": ("F32", [0, 2**20], b""),
                                   "group_sizes": ("I32", [1], b"\0" * 4)}), "mode=f32")
    assert code == 2 and "'drhs'" in err and "memory cap" in err, err


@pytest.mark.parametrize("factor", ["1e18", "1e300", "1024.5"])
def test_ragged_buffer_factor_is_bounded(op, factor):
    # Issue 9.4: 1e18 passed validation then exited 1; 1e300 converted a
    # float past the int64 range (undefined behaviour).
    code, _, err = op("moe_forward", arrays(**moe_inputs()), "num_experts=2",
                      f"ragged_buffer_factor={factor}")
    assert code == 2 and "ragged_buffer_factor" in err and "1024" in err, err


def test_ragged_buffer_factor_at_the_bound_runs(op):
    code, out, err = op("moe_forward", arrays(**moe_inputs()), "num_experts=2",
                        "ragged_buffer_factor=1024")
    assert code == 0 and out["y"].shape == (6, 8), err


def test_memory_cap_option_and_env(op):
    ins = moe_inputs(t=64, d=64, f=64, e=4)
    for pre, env, needle in [(("--memory-cap", "64K"), None, "--memory-cap"),
                             ((), {"FP8MOE_MEMORY_CAP": "64K"}, "FP8MOE_MEMORY_CAP")]:
        code, _, err = op("moe_backward", arrays(**ins), "num_experts=4", pre=pre, env=env)
        assert code == 2 and "memory cap is 65536 bytes" in err and needle in err, err
    # The option may follow the subcommand too; a generous cap runs.
    code, out, err = op("moe_backward", arrays(**ins), "num_experts=4", "--memory-cap", "1G")
    assert code == 0 and out["dwi"].shape == (4, 64, 128), err


def test_memory_cap_refuses_a_large_input_file_by_name(op):
    code, _, err = op("cast", arrays(x=np.zeros((1024, 1024), np.float32)),
                      pre=("--memory-cap", "1M"))
    assert code == 2 and '"x"' in err and "4194304 bytes" in err and "1048576 bytes" in err, err


def test_bad_memory_cap_is_exit_2(op):
    code, _, err = op("cast", arrays(x=np.zeros(4, np.float32)), pre=("--memory-cap", "lots"))
    assert code == 2 and "--memory-cap" in err and "'lots'" in err, err
    code, _, err = op("cast", arrays(x=np.zeros(4, np.float32)), env={"FP8MOE_MEMORY_CAP": "8X"})
    assert code == 2 and "FP8MOE_MEMORY_CAP" in err and "'8X'" in err, err


def test_bad_bf16_dot_setting_is_exit_2(op):
    # FP8MOE_BF16_DOT picks the GMM kernels (docs/kernels.md): a typo must not
    # leave the default in place silently.
    code, _, err = op("cast", arrays(x=np.zeros(4, np.float32)), env={"FP8MOE_BF16_DOT": "yes"})
    assert code == 2 and "FP8MOE_BF16_DOT=yes" in err and "on or off" in err, err
    for ok in ("on", "off"):
        code, _, err = op("cast", arrays(x=np.zeros(4, np.float32)), env={"FP8MOE_BF16_DOT": ok})
        assert code == 0, err


def test_moe_tokens_past_int32_rows_are_refused(op):
    code, _, err = op("moe_forward", raw({"x": ("F32", [2**31, 0], b""),
                                          "router": ("F32", [0, 2], b""),
                                          "wi": ("F32", [2, 0, 4], b""),
                                          "wo": ("F32", [2, 2, 0], b"")}), "num_experts=2")
    assert code == 2 and "int32" in err, err


# ---- 5. safetensors headers --------------------------------------------------------------

def test_duplicate_tensor_names_are_refused(op, tmp_path):
    # Issue 9.5: the last of two "x" entries silently won.
    def make(path):
        text = (b'{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                b'"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}')
        text += b" " * (-len(text) % 8)
        pathlib.Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    code, _, err = op("cast", make)
    assert code == 2 and '"x"' in err and "appears twice" in err, err


def test_utf8_bom_in_header_is_refused(op):
    code, _, err = op("cast", raw({"x": ("F32", [1], b"\0" * 4)}, prefix=b"\xef\xbb\xbf"))
    assert code == 2 and "byte order mark" in err, err


# ---- 6. zero widths in the MoE layer -----------------------------------------------------

@pytest.mark.parametrize("opname", ["moe_forward", "moe_backward"])
def test_moe_zero_width_tokens(op, opname):
    # Issue 9.6: x [1, 0] handed memcpy a null pointer (UBSan); the unit test
    # moe_robustness_test runs it under UBSan, this checks the command.
    entries = {"x": ("F32", [1, 0], b""), "router": ("F32", [0, 2], b""),
               "wi": ("F32", [2, 0, 4], b""), "wo": ("F32", [2, 2, 0], b""),
               "dy": ("F32", [1, 0], b"")}
    code, out, err = op(opname, raw(entries), "num_experts=2")
    assert code == 0, err
    assert out["y"].shape == (1, 0) and out["group_sizes"].sum() == 2


# ---- 7. every check before any work (issue 35) -------------------------------------------

def test_dlhs_unused_h_is_refused_before_the_work(op):
    # Issue 35: dout [1, 0], rhs [1, 2^31, 0], group_sizes [0], h [1, 0],
    # mode=f32 (no epilogue) allocated and poisoned its 8 GiB output, ran the
    # kernel for ~18 s and only then said h is unused.
    entries = {"dout": ("F32", [1, 0], b""), "rhs": ("F32", [1, 2**31, 0], b""),
               "group_sizes": ("I32", [1], struct.pack("<i", 0)), "h": ("F32", [1, 0], b"")}
    start = time.monotonic()
    code, _, err = op("dlhs", raw(entries), "mode=f32")
    elapsed = time.monotonic() - start
    assert code == 2 and "h is only read by epilogue dswiglu" in err, err
    assert elapsed < 5, f"{elapsed:.1f} s: the request was checked after the work"
    # Before the memory plan too: the same answer under a cap the output
    # could never fit (it used to be the cap's refusal).
    code, _, err = op("dlhs", raw(entries), "mode=f32", pre=("--memory-cap", "4K"))
    assert code == 2 and "h is only read by epilogue dswiglu" in err, err


@pytest.mark.parametrize("opname,make,keys,needle", [
    # gmm: the operands' agreement was checked by the kernel after the
    # operands were copied and quantized and the output poisoned.
    ("gmm", arrays(lhs=np.ones((4, 3), np.float32), rhs=np.ones((2, 2, 5), np.float32),
                   group_sizes=np.array([2, 2], np.int32)),
     ["mode=fake_qat"], "lhs columns must equal rhs's K = 2"),
    ("tgmm", arrays(lhs=np.ones((4, 3), np.float32), dout=np.ones((4, 5), np.float32),
                    group_sizes=np.array([2, 3], np.int32)),
     ["mode=f32"], "sum(group_sizes) = 5"),
    # moe_backward: dy's shape was checked after the whole forward.
    ("moe_backward", arrays(**{**moe_inputs(), "dy": np.ones((7, 8), np.float32)}),
     ["num_experts=2"], "dy must be F32 [6, 8]; got f32 [7, 8]"),
    # moe_forward: num_moe_token_chunks against T after the weights were
    # quantized.
    ("moe_forward", arrays(**moe_inputs()), ["num_experts=2", "num_moe_token_chunks=7"],
     "num_moe_token_chunks=7 exceeds the 6 tokens"),
])
def test_late_tensor_checks_come_before_the_memory_plan(op, opname, make, keys, needle):
    # Each of these was checked only after the memory plan (and then after
    # allocations and work): under a cap that no plan fits, the cap answered.
    code, _, err = op(opname, make, *keys, pre=("--memory-cap", "4K"))
    assert code == 2 and needle in err, err
    code, _, err = op(opname, make, *keys)
    assert code == 2 and needle in err, err


@pytest.mark.parametrize("opname,keys,needle", [
    ("quantize", ["block_size=100"], "block_size=100 is not supported"),
    ("dequantize", ["granularity=tensor", "block_size=128"], "block_size applies to granularity=row"),
    ("quantize", ["calibration=fixed,1"], "calibration"),
    ("gmm", ["mode=bf16", "lhs_calibration=fixed,1,2"], "lhs_calibration applies"),
    ("gmm", ["mode=f32", "fp8_dtype=e4m3fnuz"], "fp8_dtype applies"),
    ("dlhs", ["tile_k=0"], "tile_k=0 is invalid"),
    ("tgmm", ["dout_quant_granularity=tile"], "dout_quant_granularity applies only"),
    ("moe_forward", ["num_experts=4", "fp8_moe_native_fwd=true"], "fp8_moe_fake_quant"),
])
def test_keys_are_checked_before_the_input_is_read(fp8moe_bin, tmp_path, opname, keys, needle):
    # Keys that are wrong whatever the tensors were checked only after the
    # whole input file was read (a missing one here: its error used to win).
    p = subprocess.run([fp8moe_bin, "op", opname, "--in", str(tmp_path / "nope.safetensors"),
                        "--out", str(tmp_path / "o.safetensors"), *keys],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 2 and needle in p.stderr, p.stderr
    assert "nope.safetensors" not in p.stderr, p.stderr


# ---- check_finite ------------------------------------------------------------------------

def test_check_finite_names_tensor_count_and_first_index(op):
    lhs = np.ones((3, 4), np.float32)
    lhs[1, 2] = np.nan
    lhs[2, 0] = np.inf
    t = dict(lhs=lhs, rhs=np.ones((1, 4, 2), np.float32), group_sizes=np.array([3], np.int32))
    code, _, err = op("gmm", arrays(**t), "mode=f32", "check_finite=true")
    assert code == 2, err
    assert "'lhs'" in err and "2 NaN or Inf values" in err and "index 6 [1, 2]" in err, err
    code, out, err = op("gmm", arrays(**t), "mode=f32")  # off by default
    assert code == 0 and np.isnan(out["out"][1]).all(), err


@pytest.mark.parametrize("opname,tensors", [
    ("decode", {"y": np.array([0x7F, 1], np.uint8).view(ml_dtypes.float8_e4m3fn)}),
    ("dequantize", {"q": np.zeros((2, 3), ml_dtypes.float8_e5m2),
                    "scale": np.array([[1.0], [np.inf]], np.float32)}),
    ("moe_forward", {**moe_inputs(), "router": np.full((8, 2), np.nan, np.float32)}),
])
def test_check_finite_on_every_op(op, opname, tensors):
    extra = ["num_experts=2"] if opname.startswith("moe") else []
    code, _, err = op(opname, arrays(**tensors), "check_finite=true", *extra)
    assert code == 2 and "check_finite" in err, err


def test_check_finite_reads_u8_codes_in_their_format(op):
    """U8 codes whose format comes from format= (not from the dtype) were not
    checked at all: U8 has no NaN."""
    y = {"y": np.array([0, 0x80, 1, 2], np.uint8)}  # 0x80: NaN in e4m3fnuz, -0 in e4m3fn
    code, _, err = op("decode", arrays(**y), "check_finite=true", "format=e4m3fnuz")
    assert code == 2 and "check_finite" in err and "index 1" in err, err
    code, out, err = op("decode", arrays(**y), "check_finite=true", "format=e4m3fn")
    assert code == 0 and list(out["x"]) == [0, 0, 2.0 ** -9, 2.0 ** -8], err


# ---- concurrency and signals -------------------------------------------------------------

def test_two_writers_of_one_out_leave_one_complete_file(fp8moe_bin, tmp_path):
    rng = np.random.default_rng()
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    st.write(a, {"x": rng.standard_normal((1 << 21,)).astype(np.float32)})
    st.write(b, {"x": rng.standard_normal((1 << 20, 3)).astype(np.float32)})
    out = tmp_path / "out.safetensors"
    want = {}
    for src in (a, b):
        subprocess.run([fp8moe_bin, "op", "cast", "--in", str(src), "--out", str(out)],
                       check=True, timeout=TIMEOUT)
        want[src] = out.read_bytes()
    for _ in range(6):
        procs = [subprocess.Popen([fp8moe_bin, "op", "cast", "--in", str(s), "--out", str(out)])
                 for s in (a, b)]
        assert [p.wait(timeout=TIMEOUT) for p in procs] == [0, 0]
        assert out.read_bytes() in (want[a], want[b])
        assert sorted(x.name for x in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors",
                                                             "out.safetensors"]


def _no_partial_files(tmp_path, keep):
    left = sorted(x.name for x in tmp_path.iterdir() if x.name not in keep)
    assert left == [], f"left behind: {left}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_writing_leaves_no_partial_file(fp8moe_bin, tmp_path, sig):
    # A 256 MiB output: the temp file exists long enough to be seen; the
    # signal arrives while it is being written.
    src = tmp_path / "in.safetensors"
    raw_file(src, {"y": ("U8", [64 << 20], bytes(range(256)) * (1 << 18))})
    out = tmp_path / "out.safetensors"
    seen = False
    for _ in range(3):
        p = subprocess.Popen([fp8moe_bin, "op", "decode", "--in", str(src), "--out", str(out),
                              "format=e4m3fn"])
        deadline = time.time() + TIMEOUT
        while p.poll() is None and time.time() < deadline:
            if any(".tmp." in x.name for x in tmp_path.iterdir()):
                p.send_signal(sig)
                seen = True
                break
            time.sleep(0.0005)
        code = p.wait(timeout=TIMEOUT)
        if seen:
            assert code == -sig, code  # killed by the signal: 128 + sig in a shell
            assert not out.exists(), "a partial output was left"
            _no_partial_files(tmp_path, {"in.safetensors"})
            return
        out.unlink()
    pytest.fail("the temp file of --out was never seen; the output is too small to catch")


def _long_op_args(fp8moe_bin, tmp_path):
    """`fp8moe op gmm` on the reference twin and a shape it takes many seconds on."""
    rng = np.random.default_rng()
    src = tmp_path / "in.safetensors"
    st.write(src, {"lhs": rng.standard_normal((2048, 2048)).astype(np.float32),
                   "rhs": rng.standard_normal((1, 2048, 2048)).astype(np.float32),
                   "group_sizes": np.array([2048], np.int32)})
    return [fp8moe_bin, "op", "gmm", "--in", str(src), "--out",
            str(tmp_path / "out.safetensors"), "mode=f32", "reference=true"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_a_long_op_leaves_no_file(fp8moe_bin, tmp_path, sig):
    p = subprocess.Popen(_long_op_args(fp8moe_bin, tmp_path))
    time.sleep(1.0)
    assert p.poll() is None, "the op finished before the signal"
    p.send_signal(sig)
    assert p.wait(timeout=TIMEOUT) == -sig
    _no_partial_files(tmp_path, {"in.safetensors"})


def test_an_inherited_ignored_sigint_stays_ignored(fp8moe_bin, tmp_path):
    # nohup and `cmd &` in a script start the command with SIGINT ignored; it
    # must stay ignored (only SIGTERM ends such a run), not be replaced by the
    # temp-file cleanup handler.
    p = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$0" "$@"',
                          *_long_op_args(fp8moe_bin, tmp_path)])
    time.sleep(1.0)
    assert p.poll() is None, "the op finished before the signal"
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert p.poll() is None, "an ignored SIGINT ended the run"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=TIMEOUT) == -signal.SIGTERM
    _no_partial_files(tmp_path, {"in.safetensors"})


def test_signal_during_bench_exits_by_the_signal(fp8moe_bin, tmp_path):
    p = subprocess.Popen([fp8moe_bin, "bench", "gmm", "--reps", "1000"], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    assert p.poll() is None
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=TIMEOUT) == -signal.SIGINT
    assert list(tmp_path.iterdir()) == []


# ---- the command line itself -------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["op"], "name"),                                   # no op name, no --in/--out
    (["op", "cast", "--in", "x", "--out", "y", "--bogus"], "--bogus"),
    (["--simd", "NOSUCH", "info"], "NOSUCH"),
    (["frobnicate"], "unknown subcommand 'frobnicate'; the subcommands: info, bench"),
    (["--simd", "AVX2", "frobnicate"], "unknown subcommand 'frobnicate'"),
    (["bench", "gmm", "--threads", "0"], "--threads"),
])
def test_bad_command_lines_exit_2(fp8moe_bin, args, needle):
    p = subprocess.run([fp8moe_bin, *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 2 and needle in p.stderr, (p.returncode, p.stderr)


def test_global_options_follow_every_subcommand(fp8moe_bin):
    """docs/robustness.md: --memory-cap (and --simd) may come before or after the
    subcommand; after `info` it was refused."""
    for args in (["info", "--memory-cap", "1G"], ["info", "--simd", "AVX2"],
                 ["--memory-cap", "1G", "info"]):
        p = subprocess.run([fp8moe_bin, *args], capture_output=True, text=True, timeout=TIMEOUT)
        assert p.returncode == 0 and "simd target" in p.stdout, (args, p.stderr)


def test_a_trainer_flag_given_to_an_op_is_named_as_such(op):
    """`op moe_forward steps=5` said "unknown key ...; see configs/base.yml", which
    lists steps; ici_expert_parallelism got "did you mean 'ici_tensor_parallelism'"."""
    for opname, tensors, key in (("moe_forward", moe_inputs(), "steps=5"),
                                 ("moe_forward", moe_inputs(), "ici_expert_parallelism=2"),
                                 ("cast", {"x": np.zeros(2, np.float32)}, "learning_rate=1")):
        code, _, err = op(opname, arrays(**tensors), key, "num_experts=2"
                          if opname.startswith("moe") else "format=e4m3fn")
        name = key.split("=")[0]
        assert code == 2 and f"'{name}' is a flag of fp8moe train that op {opname}" in err, err
        assert "did you mean" not in err, err


@pytest.mark.parametrize("keys,needle", [(["noequals"], "key=value"), (["=1"], "empty key"),
                                         ([""], "empty setting"), (["format=e4m3fn=x"], "format")])
def test_malformed_keys_exit_2(op, keys, needle):
    code, _, err = op("cast", arrays(x=np.zeros(2, np.float32)), *keys)
    assert code == 2 and needle in err, err


def test_missing_or_directory_input_exit_2(fp8moe_bin, tmp_path):
    for src, needle in [(tmp_path / "nope.safetensors", "nope.safetensors"),
                        (tmp_path, "not a regular file")]:
        p = subprocess.run([fp8moe_bin, "op", "cast", "--in", str(src), "--out",
                            str(tmp_path / "o.safetensors")], capture_output=True, text=True,
                           timeout=TIMEOUT)
        assert p.returncode == 2 and needle in p.stderr, (p.returncode, p.stderr)
