# Type stub of the nanobind extension fp8moe._core (python/src/*.cc). Low
# level: arrays travel as (array, dtype name) pairs, ml_dtypes arrays viewed as
# unsigned integers of their width; results come back the same way. Use the
# documented API in fp8moe/__init__.py.
from typing import Any, Optional

import numpy as np

Result = tuple[np.ndarray, str]  # (array, fp8moe dtype name)

def version() -> str: ...
def simd_target() -> str: ...
def max_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def restrict_simd_target(name: str) -> None: ...
def has_xla_ffi() -> bool: ...
def ffi_targets() -> dict[str, object]: ...  # name -> PyCapsule

def cast(x: np.ndarray, x_dtype: str, format: str, saturate: bool) -> Result: ...
def decode(y: np.ndarray, y_dtype: str) -> Result: ...
def quantize(x: np.ndarray, x_dtype: str, dtype: str, granularity: str, block_size: int,
             calibration: str, scale_arithmetic: str, valid_rows: Optional[int],
             group_sizes: Optional[np.ndarray], gs_dtype: Optional[str],
             tile_m: int) -> tuple[Result, Result]: ...
def dequantize(q: np.ndarray, q_dtype: str, scale: np.ndarray, scale_dtype: str,
               granularity: str, block_size: int, group_sizes: Optional[np.ndarray],
               gs_dtype: Optional[str], tile_m: int) -> Result: ...

def gmm(lhs: np.ndarray, lhs_dtype: str, rhs: np.ndarray, rhs_dtype: str,
        rhs_scale: Optional[np.ndarray], rhs_scale_dtype: Optional[str],
        group_sizes: np.ndarray, gs_dtype: str, mode: str, fp8_dtype: str,
        lhs_quant_block_size: int, lhs_calibration: str, scale_arithmetic: str,
        epilogue: str, out_dtype: str, return_h: bool, tile_m: Optional[int],
        tile_k: Optional[int], tile_n: Optional[int],
        reference: bool) -> tuple[Result, Optional[Result]]: ...
def dlhs(dout: np.ndarray, dout_dtype: str, rhs: np.ndarray, rhs_dtype: str,
         rhs_scale: Optional[np.ndarray], rhs_scale_dtype: Optional[str],
         group_sizes: np.ndarray, gs_dtype: str, h: Optional[np.ndarray],
         h_dtype: Optional[str], mode: str, fp8_dtype: str, epilogue: str, out_dtype: str,
         tile_m: Optional[int], tile_k: Optional[int], tile_n: Optional[int],
         reference: bool) -> Result: ...
def tgmm(lhs: np.ndarray, lhs_dtype: str, dout: np.ndarray, dout_dtype: str,
         group_sizes: np.ndarray, gs_dtype: str, mode: str, dout_quant: str,
         per_group: bool, calibration: str, scale_arithmetic: str, tile_m: Optional[int],
         tile_k: Optional[int], tile_n: Optional[int], reference: bool) -> Result: ...

def moe_config(flags: list[str]) -> dict[str, Any]: ...
def moe_forward(flags: list[str], x: np.ndarray, x_dtype: str, router: np.ndarray,
                router_dtype: str, wi: np.ndarray, wi_dtype: str, wo: np.ndarray,
                wo_dtype: str) -> dict[str, Any]: ...
def moe_backward(flags: list[str], x: np.ndarray, x_dtype: str, router: np.ndarray,
                 router_dtype: str, wi: np.ndarray, wi_dtype: str, wo: np.ndarray,
                 wo_dtype: str, dy: np.ndarray, dy_dtype: str,
                 daux: float) -> dict[str, Any]: ...
