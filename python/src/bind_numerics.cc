// _core.cast, decode, quantize, dequantize: numerics.h and quant.h on numpy
// arrays. Checks mirror `fp8moe op cast|decode|quantize|dequantize`.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "python/src/bind.h"

namespace fp8moe::py {
namespace {

[[noreturn]] void Bad(std::string_view fn, const std::string& msg) {
  throw nb::value_error((std::string(fn) + ": " + msg).c_str());
}

void NeedDType(std::string_view fn, std::string_view name, const ConstTensorView& v, DType want,
               std::string_view hint) {
  if (v.dtype == want) return;
  Bad(fn, std::string(name) + " has dtype " + std::string(DTypeName(v.dtype)) +
              "; expected " + std::string(DTypeName(want)) + std::string(hint));
}

// x f32 -> y in `format` (an fp8 format or bf16).
nb::tuple Cast(const Array& x, const std::string& x_dtype, const std::string& format,
               bool saturate) {
  const char* fn = "cast";
  const ConstTensorView xv = View(fn, "x", x, x_dtype);
  NeedDType(fn, "x", xv, DType::kF32, " (widen other types with x.astype(np.float32))");
  const bool bf16 = format == "bf16" || format == "bfloat16";
  std::optional<Fp8Format> f;
  if (!bf16) {
    auto parsed = ParseFp8Format(format);
    if (!parsed.ok()) Bad(fn, parsed.status().message() + " (or bf16)");
    f = *parsed;
  }
  NewArray y = MakeArray(fn, bf16 ? DType::kBF16 : Fp8FormatDType(*f), xv.shape);
  const size_t n = xv.num_elements();
  const float* xs = xv.as<float>();
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    if (!bf16) {
      EncodeFp8Span(xs, y.view.as<uint8_t>(), n, *f, saturate);
    } else if (!saturate) {
      F32ToBf16Span(xs, y.view.as<uint16_t>(), n);
    } else {  // clip to the largest finite bf16 first (NaN stays NaN), as op cast does
      const float max = Bf16ToF32(0x7F7F);
      float chunk[4096];
      for (size_t i = 0; i < n; i += 4096) {
        const size_t len = std::min<size_t>(4096, n - i);
        for (size_t j = 0; j < len; ++j) {
          const float v = xs[i + j];
          chunk[j] = std::isnan(v) ? v : std::fmin(std::fmax(v, -max), max);
        }
        F32ToBf16Span(chunk, y.view.as<uint16_t>() + i, len);
      }
    }
  }
  return Out(y);
}

// y (fp8 codes or bf16) -> f32.
nb::tuple Decode(const Array& y, const std::string& y_dtype) {
  const char* fn = "decode";
  const ConstTensorView yv = View(fn, "y", y, y_dtype);
  if (!IsFp8(yv.dtype) && yv.dtype != DType::kBF16) {
    Bad(fn, "y has dtype " + std::string(DTypeName(yv.dtype)) +
                "; expected an fp8 dtype (float8_e4m3fn, float8_e4m3fnuz, "
                "float8_e5m2, float8_e5m2fnuz) or bfloat16");
  }
  NewArray x = MakeArray(fn, DType::kF32, yv.shape);
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    if (yv.dtype == DType::kBF16) {
      Bf16ToF32Span(yv.as<uint16_t>(), x.view.as<float>(), yv.num_elements());
    } else {
      DecodeFp8Span(yv.as<uint8_t>(), x.view.as<float>(), yv.num_elements(),
                    *Fp8FormatOf(yv.dtype));
    }
  }
  return Out(x);
}

// The layout of a quantize / dequantize request.
struct Layout {
  enum Kind { kTensor, kRow, kChannel, kGroupTile } kind = kRow;
  int64_t rows = 0, cols = 0, block = 0;  // row
  int64_t experts = 0, k = 0, n = 0;      // channel
  const int32_t* group_sizes = nullptr;   // group_tile
  int64_t groups = 0, tile_m = 0;
  Shape scale_shape;
};

Layout MakeLayout(std::string_view fn, const Shape& shape, const std::string& granularity,
                  int64_t block, const std::optional<ConstTensorView>& gs, int64_t tile_m) {
  Layout l;
  if (granularity == "tensor") {
    l.kind = Layout::kTensor;
  } else if (granularity == "row") {
    l.kind = Layout::kRow;
  } else if (granularity == "channel") {
    l.kind = Layout::kChannel;
  } else if (granularity == "group_tile") {
    l.kind = Layout::kGroupTile;
  } else {
    Bad(fn, "unknown granularity '" + granularity +
                "'; expected tensor, row, channel or group_tile");
  }
  if (block < 0) Bad(fn, "block_size = " + std::to_string(block) + " is negative");
  if (block != 0 && l.kind != Layout::kRow) {
    Bad(fn, "block_size applies to granularity row only; drop it or use "
            "granularity='row'");
  }
  if (gs.has_value() != (l.kind == Layout::kGroupTile)) {
    Bad(fn, gs ? "group_sizes applies to granularity group_tile only"
               : "granularity group_tile needs group_sizes (int32 [G])");
  }
  if (tile_m != 0 && l.kind != Layout::kGroupTile) {
    Bad(fn, "tile_m applies to granularity group_tile only");
  }
  switch (l.kind) {
    case Layout::kTensor:
      l.scale_shape = {1};
      break;
    case Layout::kRow:
      if (shape.size() != 2) {
        Bad(fn, "granularity row needs a rank-2 [R, C] array; got shape " +
                    ShapeToString(shape));
      }
      l.rows = shape[0];
      l.cols = shape[1];
      l.block = block;
      l.scale_shape = {l.rows, NumBlocks(l.cols, block)};
      break;
    case Layout::kChannel:
      if (shape.size() != 3 && shape.size() != 2) {
        Bad(fn, "granularity channel needs a weight [E, K, N] (or [K, N]); got shape " +
                    ShapeToString(shape));
      }
      l.experts = shape.size() == 3 ? shape[0] : 1;
      l.k = shape[shape.size() - 2];
      l.n = shape[shape.size() - 1];
      l.scale_shape = {l.experts, l.n};
      break;
    case Layout::kGroupTile: {
      if (shape.size() != 2) {
        Bad(fn, "granularity group_tile needs a rank-2 [M, C] array; got shape " +
                    ShapeToString(shape));
      }
      if (gs->dtype != DType::kI32 || gs->rank() != 1) {
        Bad(fn, "group_sizes must be int32 [G]; got " + std::string(DTypeName(gs->dtype)) +
                    " " + ShapeToString(gs->shape));
      }
      l.rows = shape[0];
      l.cols = shape[1];
      l.group_sizes = gs->as<int32_t>();
      l.groups = gs->shape[0];
      l.tile_m = tile_m;
      auto tiles = NumGroupTiles(l.group_sizes, l.groups, l.rows, tile_m);
      ThrowIfError(fn, tiles.status());
      l.scale_shape = {*tiles, l.cols};
      break;
    }
  }
  return l;
}

std::optional<ConstTensorView> OptionalView(std::string_view fn, const char* name,
                                            const std::optional<Array>& a,
                                            const std::optional<std::string>& dtype) {
  if (!a) return std::nullopt;
  return View(fn, name, *a, dtype.value_or(""));
}

// x f32 -> (q codes, scale f32).
nb::tuple Quantize(const Array& x, const std::string& x_dtype, const std::string& dtype,
                   const std::string& granularity, int64_t block_size,
                   const std::string& calibration, const std::string& arithmetic,
                   std::optional<int64_t> valid_rows, std::optional<Array> group_sizes,
                   std::optional<std::string> gs_dtype, int64_t tile_m) {
  const char* fn = "quantize";
  const ConstTensorView xv = View(fn, "x", x, x_dtype);
  NeedDType(fn, "x", xv, DType::kF32, " (widen other types with x.astype(np.float32))");
  auto qdt = ParseQuantDType(dtype);
  ThrowIfError(fn, qdt.status());
  auto cal = Calibration::Parse(calibration);
  ThrowIfError(fn, cal.status());
  auto arith = ParseScaleArithmetic(arithmetic);
  ThrowIfError(fn, arith.status());
  cal->arithmetic = *arith;
  const auto gs = OptionalView(fn, "group_sizes", group_sizes, gs_dtype);
  const Layout l = MakeLayout(fn, xv.shape, granularity, block_size, gs, tile_m);
  if (valid_rows && l.kind != Layout::kRow) {
    Bad(fn, "valid_rows applies to granularity row only");
  }
  NewArray q = MakeArray(fn, QuantStorageDType(*qdt), xv.shape);
  NewArray s = MakeArray(fn, DType::kF32, l.scale_shape);
  Status st;
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    const float* xs = xv.as<float>();
    uint8_t* qs = q.view.as<uint8_t>();
    float* ss = s.view.as<float>();
    switch (l.kind) {
      case Layout::kTensor:
        st = QuantizeTensor(xs, static_cast<int64_t>(xv.num_elements()), *qdt, *cal, qs, ss);
        break;
      case Layout::kRow:
        st = QuantizeRows(xs, l.rows, l.cols, valid_rows.value_or(l.rows), l.block, *qdt,
                          *cal, qs, ss);
        break;
      case Layout::kChannel:
        st = QuantizeChannels(xs, l.experts, l.k, l.n, *qdt, *cal, qs, ss);
        break;
      case Layout::kGroupTile:
        st = QuantizeGroupTileChannels(xs, l.rows, l.cols, l.group_sizes, l.groups,
                                       l.tile_m, *qdt, *cal, qs, ss);
        break;
    }
  }
  ThrowIfError(fn, st);
  return nb::make_tuple(Out(q), Out(s));
}

// (q codes, scale f32) -> x f32.
nb::tuple Dequantize(const Array& q, const std::string& q_dtype, const Array& scale,
                     const std::string& scale_dtype, const std::string& granularity,
                     int64_t block_size, std::optional<Array> group_sizes,
                     std::optional<std::string> gs_dtype, int64_t tile_m) {
  const char* fn = "dequantize";
  const ConstTensorView qv = View(fn, "q", q, q_dtype);
  auto qdt = QuantDTypeOf(qv.dtype);
  if (!qdt.ok()) Bad(fn, "q " + qdt.status().message());
  const ConstTensorView sv = View(fn, "scale", scale, scale_dtype);
  NeedDType(fn, "scale", sv, DType::kF32, "");
  const auto gs = OptionalView(fn, "group_sizes", group_sizes, gs_dtype);
  const Layout l = MakeLayout(fn, qv.shape, granularity, block_size, gs, tile_m);
  if (sv.shape != l.scale_shape) {
    Bad(fn, "scale has shape " + ShapeToString(sv.shape) + "; granularity " + granularity +
                " of q " + ShapeToString(qv.shape) + " needs " +
                ShapeToString(l.scale_shape));
  }
  NewArray x = MakeArray(fn, DType::kF32, qv.shape);
  Status st;
  {
    nb::gil_scoped_release release;
    LibraryCall call;
    const uint8_t* qs = qv.as<uint8_t>();
    const float* ss = sv.as<float>();
    float* xs = x.view.as<float>();
    switch (l.kind) {
      case Layout::kTensor:
        DequantizeTensor(qs, static_cast<int64_t>(qv.num_elements()), ss[0], *qdt, xs);
        break;
      case Layout::kRow:
        DequantizeRows(qs, l.rows, l.cols, l.block, ss, *qdt, xs);
        break;
      case Layout::kChannel:
        DequantizeChannels(qs, l.experts, l.k, l.n, ss, *qdt, xs);
        break;
      case Layout::kGroupTile:
        st = DequantizeGroupTileChannels(qs, l.rows, l.cols, l.group_sizes, l.groups,
                                         l.tile_m, ss, *qdt, xs);
        break;
    }
  }
  ThrowIfError(fn, st);
  return Out(x);
}

}  // namespace

void BindNumerics(nb::module_& m) {
  m.def("cast", &Cast, nb::arg("x"), nb::arg("x_dtype"), nb::arg("format"),
        nb::arg("saturate"));
  m.def("decode", &Decode, nb::arg("y"), nb::arg("y_dtype"));
  m.def("quantize", &Quantize, nb::arg("x"), nb::arg("x_dtype"), nb::arg("dtype"),
        nb::arg("granularity"), nb::arg("block_size"), nb::arg("calibration"),
        nb::arg("scale_arithmetic"), nb::arg("valid_rows").none(),
        nb::arg("group_sizes").none(), nb::arg("gs_dtype").none(), nb::arg("tile_m"));
  m.def("dequantize", &Dequantize, nb::arg("q"), nb::arg("q_dtype"), nb::arg("scale"),
        nb::arg("scale_dtype"), nb::arg("granularity"), nb::arg("block_size"),
        nb::arg("group_sizes").none(), nb::arg("gs_dtype").none(), nb::arg("tile_m"));
}

}  // namespace fp8moe::py
