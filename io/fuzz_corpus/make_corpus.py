#!/usr/bin/env python3
"""Writes the seed corpus for io/safetensors_fuzz.cc into this directory.

Valid files of several dtypes and shapes (empty tensors, scalars, metadata,
fnuz formats) plus a few malformed ones. Standard library only; the output is
deterministic, so rerunning it changes nothing.

    python3 io/fuzz_corpus/make_corpus.py
"""
import json
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
         "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
         "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
rng = random.Random(20240601)


def header_bytes(header):
    """Length prefix + compact JSON padded with spaces to a multiple of 8."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def valid(tensors, metadata=None):
    """tensors: list of (name, dtype, shape); data is random, bools 0/1."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        if dtype == "BOOL":
            chunk = bytes(rng.randrange(2) for _ in range(n))
        else:
            chunk = bytes(rng.randrange(256) for _ in range(n))
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + n]}
        data += chunk
    return header_bytes(header) + data


def raw(header_text, data=b""):
    return struct.pack("<Q", len(header_text)) + header_text + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


FILES = {
    # ---- valid ----
    "valid_empty": valid([]),
    "valid_metadata_only": valid([], {"format": "pt", "step": "100"}),
    "valid_f32_matrix": valid([("w", "F32", [2, 3])]),
    "valid_scalars": valid([("step", "I64", []), ("lr", "F32", [])]),
    "valid_zero_size": valid([("a", "F32", [0]), ("b", "BF16", [3, 0]),
                              ("c", "U8", [2]), ("d", "I8", [0, 0])]),
    "valid_all_dtypes": valid([(d.lower(), d, [2]) for d in SIZES]),
    "valid_fp8": valid([("codes", "F8_E4M3", [2, 4]),
                        ("grad", "F8_E5M2", [4]),
                        ("scale", "F32", [2])]),
    "valid_fnuz": valid([("w", "U8", [2, 2]), ("g", "U8", [3])],
                        {"w.format": "e4m3fnuz", "g.format": "e5m2fnuz",
                         "note": "fnuz"}),
    "valid_bool_mask": valid([("mask", "BOOL", [3, 3])]),
    "valid_official_pt": valid([("model.layers.0.weight", "BF16", [4, 2]),
                                ("model.layers.0.bias", "F16", [4])],
                               {"format": "pt"}),
    "valid_keys_out_of_order": raw(
        json.dumps({"z": entry("U16", [1], 0, 2),
                    "a": entry("U16", [2], 2, 6)}).encode(), bytes(6)),
    # ---- malformed ----
    "bad_short": b"\x05\x00\x00\x00\x00",
    "bad_header_past_end": struct.pack("<Q", 1000) + b"{}",
    "bad_not_json": raw(b'{"w": {"dtype": "F32", '),
    "bad_unknown_dtype": raw(json.dumps(
        {"w": entry("F8_E8M0", [1], 0, 1)}).encode(), b"\x00"),
    "bad_size_mismatch": raw(json.dumps(
        {"w": entry("F32", [2], 0, 4)}).encode(), bytes(4)),
    "bad_negative_dim": raw(json.dumps(
        {"w": entry("U8", [-1], 0, 0)}).encode()),
    "bad_overlap": raw(json.dumps(
        {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}).encode(),
        bytes(6)),
    "bad_hole_and_trailing": raw(json.dumps(
        {"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}).encode(),
        bytes(9)),
    "bad_format": raw(json.dumps(
        {"__metadata__": {"w.format": "e4m3", "v.format": "e5m2fnuz"},
         "w": entry("I8", [1], 0, 1)}).encode(), b"\x00"),
}

if __name__ == "__main__":
    for name, content in FILES.items():
        with open(os.path.join(HERE, name + ".safetensors"), "wb") as f:
            f.write(content)
    print(f"wrote {len(FILES)} files to {HERE}")
