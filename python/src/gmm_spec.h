// The options of a GMM, dLHS or TGMM call as Python spells them (strings and
// ints), turned into the library's GmmOptions / TgmmQuant. Shared by the
// nanobind bindings and the XLA FFI handlers, so both accept the same
// spellings with the same error messages.
#ifndef FP8MOE_PYTHON_SRC_GMM_SPEC_H_
#define FP8MOE_PYTHON_SRC_GMM_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>

#include "fp8moe/gmm.h"
#include "fp8moe/status.h"

namespace fp8moe::py {

struct GmmSpec {
  std::string mode = "bf16";         // f32, bf16, fake_qat, native_fp8, int8
  std::string fp8_dtype = "e4m3fn";  // native_fp8 / fake_qat codes
  std::string epilogue = "none";     // none, swiglu (gmm), dswiglu (dlhs)
  int64_t lhs_quant_block_size = 0;  // native_fp8: 0, 128 or 512
  std::string lhs_calibration = "absmax";          // native_fp8, int8
  std::string scale_arithmetic = "exact_divide";   // of every quantization
  std::optional<int64_t> tile_m, tile_k, tile_n;   // unset: per shape
};

Result<GmmOptions> ToGmmOptions(const GmmSpec& spec);

struct TgmmSpec {
  std::string dout_quant = "none";  // none, e5m2, e4m3fn (e4m3 too)
  bool per_group = true;            // a scale per (group, channel), else per m-tile
  std::string calibration = "absmax";
  std::string scale_arithmetic = "exact_divide";
};

Result<TgmmQuant> ToTgmmQuant(const TgmmSpec& spec);

// Output shapes from the input shapes; a dimension of an input with the wrong
// rank counts as 0, and the library then reports the rank error with its own
// message.
//  gmm:  out [M, N] (swiglu: [M, N / 2]), h [M, N]
//  dlhs: [M, K] (dswiglu: [M, 2K])
//  tgmm: [E, K, N]
Shape GmmOutShape(const Shape& lhs, const Shape& rhs, bool swiglu);
Shape DlhsOutShape(const Shape& dout, const Shape& rhs, bool dswiglu);
Shape TgmmOutShape(const Shape& lhs, const Shape& dout, const Shape& group_sizes);

}  // namespace fp8moe::py

#endif  // FP8MOE_PYTHON_SRC_GMM_SPEC_H_
