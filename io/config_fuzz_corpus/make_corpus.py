#!/usr/bin/env python3
"""Writes the seed corpus of io/config_fuzz.cc into this directory: YAML text,
then key=value overrides, separated by NUL bytes. The trainer's defaults
(configs/base.yml), valid QAT configurations, and the hostile values of
issue 9 and of YAML itself (duplicate keys, nesting, anchors, tags, several
documents, huge numbers, quoting, tabs, values over several lines), and the
inputs yaml-cpp 0.7 looped on before the flat reader replaced it. Standard library only; deterministic.

    python3 io/config_fuzz_corpus/make_corpus.py
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

with open(os.path.join(ROOT, "configs", "base.yml"), "rb") as f:
    BASE = f.read()

SEEDS = {
    "base": BASE,
    # The trainer's flags (TrainConfigSchema): sizes whose products overflowed,
    # huge models for the memory plan, bad run names and step counts.
    "train_tiny": (b"base_emb_dim: 16\nbase_num_decoder_layers: 2\nhead_dim: 8\n"
                   b"base_moe_mlp_dim: 16\nmax_target_length: 16\nper_device_batch_size: 4\n"
                   b"vocab_size: 40\nsynthetic_alphabet_size: 8\nsteps: 12\n"),
    "train_batch_overflow": b"per_device_batch_size: 4611686018427387904\nmax_target_length: 4\n",
    "train_heads_overflow": b"\0base_num_query_heads=2147483647\0head_dim=2147483646",
    "train_huge_model": b"base_emb_dim: 100000\nnum_experts: 1000\nbase_moe_mlp_dim: 100000\n",
    "train_layers": b"base_num_decoder_layers: 1000000000000\n",
    "train_run_name": b"run_name: ../x\nbase_output_directory: ''\n\0run_name=a/b",
    "train_steps": b"steps: 0\neval_steps: 4611686018427387904\nlog_period: 0\n",
    "train_synthetic": (b"synthetic_num_sources: 9223372036854775807\n"
                        b"synthetic_alphabet_size: 9223372036854775807\n"
                        b"synthetic_branching: 1000000000000\n"),
    "train_adam": b"adam_b1: 1\nadam_b2: -0.5\nadam_eps: 0\nlearning_rate: 1e308\n",
    "base_with_overrides": BASE + b"\0num_experts=16\0num_experts_per_tok=4",
    "fake_qat": b"num_experts: 4\nfp8_moe_fake_quant: true\n",
    "native": (b"fp8_moe_fake_quant: true\nfp8_fake_quant_hoist: gather8\n"
               b"fp8_moe_native_fwd: true\nfp8_moe_native_bwd_dlhs: true\n"
               b"moe_lhs_quant_block_size: 128\n"),
    "fp8_full": (b"quantization: fp8_full\nuse_qwix_quantization: true\n"
                 b"moe_bwd_inkernel_quant: true\nbwd_quantization_dtype: e4m3\n"
                 b"bwd_quantization_calibration_method: fixed,-448,448\n"),
    "tiles": b"wi_tile_fwd_batch_seq: 256\nwo_tile_dlhs_embed_dim: 128\n\0wi_tile_drhs_embed_dim=64",
    "tile_overflow": b"wi_tile_fwd_batch_seq: 9223372036854775807\n",
    "tile_1e8": b"\0wo_tile_fwd_mlp_dim=100000000",
    "ragged_1e18": b"ragged_buffer_factor: 1e18\n",
    "ragged_1e300": b"\0ragged_buffer_factor=1e300",
    "ragged_inf": b"ragged_buffer_factor: .inf\n",
    "big_int": b"num_experts: 99999999999999999999\n",
    "experts_past_int32": b"num_experts: 2147483648\nnum_experts_per_tok: 1\n",
    "duplicate_key": b"num_experts: 4\nnum_experts: 8\n",
    "nested": b"num_experts:\n  a: 1\n",
    "flow_nested": b"dtype: [[[[[[[[]]]]]]]]\n",
    "anchors": b"a: &x 4\nnum_experts: *x\n",
    "tags": b"num_experts: !!int 4\ndtype: !!binary aGVsbG8=\n",
    "two_documents": b"num_experts: 4\n---\nnum_experts: 8\n",
    "null_values": b"quantization:\nnum_experts: ~\n",
    "bools_yes_no": b"sparse_matmul: yes\nnorm_topk_prob: off\n",
    "unicode": "dtype: \u00e9\u00e8\nquantization: \"\\u0000\"\n".encode(),
    "bom": b"\xef\xbb\xbfnum_experts: 4\n",
    "bad_overrides": b"\0=1\0num_experts\0num_experts==4\0unknown_key=1\0num_expert=4",
    "calibration": b"weight_quantization_calibration_method: fixed,nan,1\n"
                   b"act_quantization_calibration_method: fixed,1e39,1\n",
    # The flat reader (io/flat_yaml.h): quoting, escapes, markers, CRLF, and
    # the forms it refuses; the inputs yaml-cpp 0.7 looped on forever.
    "quoting": (b"--- # c\r\nrun_name: 'it''s # not' # c\r\n"
                b"dtype: \"\\x41\\u00e9\\U0001F600\\t\\\"\\\\\" # c\r\n"
                b"quantization: fp8 # c\r\n...\r\n"),
    "multiline": b"run_name:\n  a\n  b\nnum_experts: 4\n  5\n",
    "block_scalar": b"run_name: |\n  x\n",
    "tabs": b"run_name:\tx\n\t\nnum_experts: 4\t# c\n",
    "hang_ff": b",ed_buffer_factor: \xff.inf\n",
    "hang_anchor_nul": b"&m_exp,\0\0experts: *x\n",
    "hang_comma": b",teps: 0\n",
    # Overrides ToYaml could not write back before (config_fuzz): NEL, which
    # YAML 1.1 breaks lines at, and a byte that is not UTF-8.
    "override_nel": b"\0weight_quantization_calibration_method=a\xc2\x85" b"b",
    "override_not_utf8": b"\0weight_quantization_calibration_method=a\xff" b"b",
}

if __name__ == "__main__":
    for name, data in SEEDS.items():
        with open(os.path.join(HERE, name + ".txt"), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {HERE}")
