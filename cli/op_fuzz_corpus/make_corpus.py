#!/usr/bin/env python3
"""Writes the seed corpus of cli/op_fuzz.cc into this directory: one or more
plausible requests per op (every gmm mode and epilogue, tgmm with in-kernel
quantization, the MoE QAT modes) and the reproducers of issue 9, encoded in
the fuzzer's input format (see the comment at the top of op_fuzz.cc). Keys,
values and tensor names are written as explicit strings, so the seeds do not
depend on the order of any table or schema. Standard library only;
deterministic, so rerunning it changes nothing.

    python3 cli/op_fuzz_corpus/make_corpus.py
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = ["cast", "decode", "quantize", "dequantize", "gmm", "dlhs", "tgmm", "moe_forward",
       "moe_backward"]  # AllOps() order
DTYPES = ["F32", "F64", "F16", "BF16", "E4M3FN", "E4M3FNUZ", "E5M2", "E5M2FNUZ", "BOOL", "I8",
          "U8", "I16", "U16", "I32", "U32", "I64", "U64"]  # kDTypes order
HUGE = [2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1]  # kHugeDims order (first five)
FILL = {"raw": 0, "normal": 1, "special": 2, "small": 3}


def s(text):
    b = text.encode()
    assert len(b) < 256
    return bytes([len(b)]) + b


def dim(d):
    if d <= 64:
        return bytes([d])
    return bytes([0xC0 + HUGE.index(d)])


def case(op, keys, tensors):
    """keys: ["k=v", ...]; tensors: [(name, dtype, shape, fill, seed_or_bytes)]."""
    out = bytes([OPS.index(op), len(keys)])
    for kv in keys:
        k, v = kv.split("=", 1)
        out += b"\xff" + s(k) + b"\xff" + s(v)
    out += bytes([len(tensors)])
    for name, dtype, shape, fill, data in tensors:
        out += b"\xff" + s(name) + bytes([DTYPES.index(dtype), len(shape)])
        out += b"".join(dim(d) for d in shape)
        out += bytes([FILL[fill]])
        out += data if fill == "raw" else struct.pack("<I", data)
    return out


def gs(sizes):
    return ("group_sizes", "I32", [len(sizes)], "raw", struct.pack(f"<{len(sizes)}i", *sizes))


SEEDS = {
    "cast_e4m3": case("cast", ["format=e4m3fn"], [("x", "F32", [4, 8], "special", 1)]),
    "cast_bf16_saturate": case("cast", ["format=bf16", "saturate=true"],
                               [("x", "F32", [33], "special", 2)]),
    "decode_fnuz": case("decode", [], [("y", "E5M2FNUZ", [64], "raw", bytes(range(64)))]),
    "decode_u8_bf16": case("decode", ["format=bf16"], [("y", "U8", [16], "raw", b"\x3f" * 16)]),
    "quantize_row_block": case("quantize", ["granularity=row", "block_size=128", "dtype=e5m2"],
                               [("x", "F32", [3, 64], "normal", 3)]),
    "quantize_channel": case("quantize", ["granularity=channel", "dtype=int8",
                                          "calibration=fixed,-2,2"],
                             [("x", "F32", [2, 5, 7], "normal", 4)]),
    # op_fuzz once compared these with the reference in exact_divide arithmetic.
    "quantize_tensor_xla": case("quantize", ["scale_arithmetic=xla_reciprocal"],
                                [("x", "F32", [48, 40], "special", 11)]),
    "quantize_row_xla": case("quantize", ["granularity=row", "scale_arithmetic=xla_reciprocal",
                                          "dtype=e5m2"],
                             [("x", "F32", [5, 33], "normal", 12)]),
    "quantize_channel_xla": case("quantize", ["granularity=channel",
                                              "scale_arithmetic=xla_reciprocal", "dtype=int8"],
                                 [("x", "F32", [2, 9, 6], "special", 13)]),
    # A NaN x with a NaN scale: x * (1 / s) gave the scale's NaN (the code's sign).
    "quantize_tensor_xla_nan": case("quantize", ["scale_arithmetic=xla_reciprocal"],
                                    [("x", "F32", [2, 2], "raw",
                                      struct.pack("<4I", 0xFFFFFFFF, 0x3F800000, 0xC0000000,
                                                  0x7FC00000))]),
    "quantize_channel_empty_huge": case("quantize", ["granularity=channel"],
                                        [("x", "F32", [2**40, 0], "raw", b"")]),
    "dequantize_tensor": case("dequantize", ["granularity=tensor"],
                              [("q", "E4M3FN", [10], "normal", 5), ("scale", "F32", [1], "normal", 6)]),
    # (sum qa qw) * s_a passes FLT_MAX in f32 while the exact product, FLT_MAX / 4,
    # is finite (docs/numerics.md): the row is not compared.
    "gmm_native_near_flt_max": case("gmm", ["mode=native_fp8", "lhs_quant_block_size=128"],
                                    [("lhs", "F32", [2, 2], "raw",
                                      struct.pack("<4f", 3.4028234663852886e38, 0.5, 1, 2)),
                                     ("rhs", "F32", [1, 2, 1], "raw", struct.pack("<2f", 0.25, 1)),
                                     gs([2])]),
    # No experts, 2^40 channels: quantizing rhs once allocated one int per channel.
    "gmm_fake_qat_no_experts_huge_n": case("gmm", ["mode=fake_qat"],
                                           [("lhs", "BF16", [0, 28], "raw", b""),
                                            ("rhs", "BF16", [0, 28, 2**40], "raw", b"")]),
    "gmm_native_xla_fixed": case("gmm", ["mode=native_fp8", "scale_arithmetic=xla_reciprocal",
                                         "lhs_calibration=fixed,-2,2"],
                                 [("lhs", "F32", [9, 33], "normal", 21),
                                  ("rhs", "F32", [2, 33, 10], "normal", 22), gs([4, 5])]),
    "tgmm_tile_xla": case("tgmm", ["mode=f32", "dout_quant=e4m3", "dout_quant_granularity=tile",
                                   "scale_arithmetic=xla_reciprocal", "tile_m=4"],
                          [("lhs", "F32", [11, 6], "normal", 23),
                           ("dout", "F32", [11, 7], "special", 24), gs([6, 5])]),
    "gmm_f32_tail": case("gmm", ["mode=f32"], [("lhs", "F32", [9, 7], "normal", 7),
                                               ("rhs", "F32", [3, 7, 5], "normal", 8), gs([2, 0, 5])]),
    "gmm_bf16_tiles": case("gmm", ["mode=bf16", "tile_m=2", "tile_k=4", "tile_n=3"],
                           [("lhs", "BF16", [9, 7], "normal", 9),
                            ("rhs", "BF16", [3, 7, 5], "normal", 10), gs([4, 1, 3])]),
    "gmm_fake_qat_codes": case("gmm", ["mode=fake_qat", "out_dtype=bf16"],
                               [("lhs", "BF16", [6, 8], "normal", 11),
                                ("rhs_codes", "E5M2", [2, 8, 4], "normal", 12),
                                ("rhs_scale", "F32", [2, 4], "small", 13), gs([3, 2])]),
    "gmm_native_block": case("gmm", ["mode=native_fp8", "lhs_quant_block_size=128",
                                     "fp8_dtype=e4m3fnuz"],
                             [("lhs", "F32", [5, 40], "normal", 14),
                              ("rhs", "F32", [2, 40, 6], "normal", 15), gs([1, 4])]),
    "gmm_int8_swiglu": case("gmm", ["mode=int8", "epilogue=swiglu"],
                            [("lhs", "BF16", [7, 12], "normal", 16),
                             ("rhs", "F32", [2, 12, 8], "normal", 17), gs([3, 3])]),
    "gmm_swiglu_specials": case("gmm", ["mode=f32", "epilogue=swiglu"],
                                [("lhs", "F32", [4, 6], "special", 18),
                                 ("rhs", "F32", [1, 6, 4], "normal", 19), gs([4])]),
    "gmm_tile_overflow": case("gmm", ["mode=f32", "tile_m=9223372036854775807"],
                              [("lhs", "F32", [2, 1], "raw", struct.pack("<2f", 1, 1)),
                               ("rhs", "F32", [2, 1, 1], "raw", struct.pack("<2f", 1, 2)),
                               gs([1, 1])]),
    "gmm_empty_huge_k": case("gmm", ["mode=fake_qat"],
                             [("lhs", "BF16", [0, 2**40], "raw", b""),
                              ("rhs", "BF16", [1, 2**40, 0], "raw", b""), gs([0])]),
    "gmm_output_too_large": case("gmm", ["mode=f32"],
                                 [("lhs", "F32", [2**40, 0], "raw", b""),
                                  ("rhs", "F32", [1, 0, 1], "raw", b""), gs([0])]),
    "dlhs_bf16_codes": case("dlhs", ["mode=bf16"],
                            [("dout", "BF16", [6, 5], "normal", 20),
                             ("rhs_codes", "E4M3FN", [2, 7, 5], "normal", 21),
                             ("rhs_scale", "F32", [2, 5], "small", 22), gs([2, 3])]),
    "dlhs_dswiglu": case("dlhs", ["mode=f32", "epilogue=dswiglu"],
                         [("dout", "F32", [5, 6], "normal", 23),
                          ("rhs", "F32", [2, 4, 6], "normal", 24), ("h", "F32", [5, 8], "normal", 25),
                          gs([2, 2])]),
    "tgmm_bf16": case("tgmm", ["mode=bf16"], [("lhs", "BF16", [8, 5], "normal", 26),
                                             ("dout", "BF16", [8, 3], "normal", 27), gs([3, 0, 4])]),
    "tgmm_quant_tile": case("tgmm", ["mode=bf16", "dout_quant=e5m2",
                                     "dout_quant_granularity=tile", "tile_m=2"],
                            [("lhs", "E4M3FN", [9, 4], "normal", 28),
                             ("dout", "F32", [9, 6], "normal", 29), gs([5, 4])]),
    "tgmm_empty_huge": case("tgmm", [], [("lhs", "BF16", [0, 2**40], "raw", b""),
                                        ("dout", "BF16", [0, 0], "raw", b""), gs([0])]),
    "moe_forward_f32": case("moe_forward", ["num_experts=2", "dtype=float32"],
                            [("x", "F32", [6, 8], "normal", 30), ("router", "F32", [8, 2], "normal", 31),
                             ("wi", "F32", [2, 8, 6], "normal", 32), ("wo", "F32", [2, 3, 8], "normal", 33)]),
    "moe_backward_native": case("moe_backward",
                                ["num_experts=3", "num_experts_per_tok=2", "fp8_moe_fake_quant=true",
                                 "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true",
                                 "wi_tile_fwd_batch_seq=2", "ragged_buffer_factor=0.5"],
                                [("x", "F32", [5, 4], "normal", 34), ("router", "F32", [4, 3], "normal", 35),
                                 ("wi", "F32", [3, 4, 4], "normal", 36), ("wo", "F32", [3, 2, 4], "normal", 37),
                                 ("dy", "F32", [5, 4], "normal", 38)]),
    "moe_backward_fp8_full": case("moe_backward",
                                  ["num_experts=2", "quantization=fp8_full",
                                   "use_qwix_quantization=true", "moe_bwd_inkernel_quant=true"],
                                  [("x", "F32", [4, 4], "normal", 39), ("router", "F32", [4, 2], "normal", 40),
                                   ("wi", "F32", [2, 4, 4], "normal", 41), ("wo", "F32", [2, 2, 4], "normal", 42),
                                   ("dy", "F32", [4, 4], "normal", 43)]),
    "moe_zero_width": case("moe_backward", ["num_experts=2"],
                           [("x", "F32", [1, 0], "raw", b""), ("router", "F32", [0, 2], "raw", b""),
                            ("wi", "F32", [2, 0, 4], "raw", b""), ("wo", "F32", [2, 2, 0], "raw", b""),
                            ("dy", "F32", [1, 0], "raw", b"")]),
    "moe_ragged_huge": case("moe_forward", ["num_experts=2", "ragged_buffer_factor=1e300"],
                            [("x", "F32", [2, 2], "normal", 44), ("router", "F32", [2, 2], "normal", 45),
                             ("wi", "F32", [2, 2, 2], "normal", 46), ("wo", "F32", [2, 1, 2], "normal", 47)]),
    "check_finite": case("gmm", ["mode=f32", "check_finite=true"],
                         [("lhs", "F32", [3, 3], "special", 48), ("rhs", "F32", [1, 3, 2], "normal", 49),
                          gs([3])]),
}

if __name__ == "__main__":
    for name, data in SEEDS.items():
        with open(os.path.join(HERE, name + ".bin"), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {HERE}")
