"""A minimal safetensors reader/writer for the tests, written from the format
description (8-byte little-endian header length, JSON header, byte buffer), so
the tests do not trust fp8moe's own reader to check fp8moe's output."""
import json
import struct

import ml_dtypes
import numpy as np

# safetensors dtype name -> numpy dtype. fnuz formats are U8 + metadata.
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
    "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_FNUZ = {"e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
         "e5m2fnuz": ml_dtypes.float8_e5m2fnuz}


def _name_of(dtype):
    for name, d in _DTYPES.items():
        if np.dtype(d) == dtype:
            return name, None
    for fmt, d in _FNUZ.items():
        if np.dtype(d) == dtype:
            return "U8", fmt
    raise ValueError(f"no safetensors dtype for {dtype}")


def write(path, tensors, metadata=None):
    header = {}
    meta = dict(metadata or {})
    blobs, offset = [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        st_name, fnuz = _name_of(arr.dtype)
        if fnuz:
            meta[f"{name}.format"] = fnuz
        data = arr.tobytes()
        header[name] = {"dtype": st_name, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if meta:
        header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    body = raw[8 + n:]
    out = {}
    for name, e in header.items():
        dtype = _DTYPES[e["dtype"]]
        if f"{name}.format" in meta:
            dtype = _FNUZ[meta[f"{name}.format"]]
        b, end = e["data_offsets"]
        out[name] = np.frombuffer(body[b:end], dtype=dtype).reshape(e["shape"])
    return out


def read_metadata(path):
    """The file's __metadata__ entries (a dict of strings)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header.get("__metadata__", {})
