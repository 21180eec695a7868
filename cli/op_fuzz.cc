// libFuzzer target for `fp8moe op`: the bytes decode into an op, its keys and
// a set of named tensors of any dtype and shape, which go through
// RunOpOnTensors, the code path of the command between reading --in and
// writing --out. See io/FUZZING.md; seeds: cli/op_fuzz_corpus/make_corpus.py.
//
// A contract break aborts (libFuzzer keeps the input):
//  - a status other than ok or a bad-request error (exit code 1: internal
//    or I/O), or an error without a message;
//  - outputs that do not serialize and parse back the same;
//  - a wrong answer against a twin: gmm / dlhs / tgmm against the reference
//    (reference=true) within the f32 accumulation bound gamma_R * sum|a b|
//    (sum|a b| from the reference on |inputs|); cast and decode against the
//    scalar conversions; quantize against the plain-loop quantizers; the same
//    bits whether tile keys are given or not (gmm family and the MoE ops),
//    and for dlhs from codes in mode bf16 and mode fake_qat (gmm.h);
//  - and whatever the sanitizers, the leak checker and -timeout catch.
//
// Caps keep each input fast under ASan: at most 2^16 input elements in all,
// data dimensions of at most 520 (enormous dimensions only beside a zero, so
// the tensor is empty), and a 256 MiB memory cap (memory.h), so large outputs
// take the refusal path the command takes. The kernels' scratch is released
// after every input, so each input runs from the same state (replayable).
//
// Input format (little-endian, read in order; reading past the end gives 0):
//   u8 op (index into AllOps(), mod count)
//   u8 key count (mod 12), then per key:
//     u8 name: < 0xF0 -> the op's key (mod count), else a u8-length string
//     u8 value: < 0xF0 -> a value table of the key's type (mod size),
//               else a u8-length string
//   u8 tensor count (mod 8), then per tensor:
//     u8 name: < 0xF0 -> kNames (mod count), else a u8-length string
//     u8 dtype (mod 17), u8 rank (mod 5),
//     rank x u8 dim: < 0xC0 -> dim % 65, else kHugeDims (mod count)
//     u8 fill: 0 raw bytes from the input, 1 normal values, 2 normal values
//       with specials (NaN, Inf, huge, subnormal), 3 small integers 0..3;
//       1-3 take a u32 seed.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cli/op.h"
#include "fp8moe/gmm.h"
#include "fp8moe/memory.h"
#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"

namespace fp8moe::cli {
namespace {

constexpr size_t kMaxInputElements = size_t{1} << 16;
constexpr uint64_t kFuzzMemoryCap = uint64_t{256} << 20;

const char* const kNames[] = {"x",   "y",  "q",      "scale",  "lhs",         "rhs",
                              "rhs_codes", "rhs_scale", "dout", "h", "group_sizes",
                              "router", "wi", "wo", "dy", "extra"};
const int64_t kHugeDims[] = {int64_t{1} << 31, (int64_t{1} << 32) + 1, int64_t{1} << 40,
                             int64_t{1} << 62, std::numeric_limits<int64_t>::max(),
                             65, 127, 128, 129, 511, 512, 513};
const char* const kBoolValues[] = {"true", "false", "True", "1", "yes", ""};
const char* const kIntValues[] = {
    "0",   "1",    "2",     "-1",       "3",          "8",           "16",
    "64",  "128",  "512",   "1048576",  "1048577",    "100000000",   "2147483648",
    "4611686018427387904",  "9223372036854775807",    "-9223372036854775808",
    "99999999999999999999", " 1",       "0x10",       "+5",          "6"};
const char* const kFloatValues[] = {"0",    "-1",   "1",      "0.5",   "2",   "1e18", "1e300",
                                    "-1e300", "1e-300", "inf", "nan", "1024", "1025", "1e6",
                                    "-0",   "0.01"};
const char* const kStringExtras[] = {"",        "x",          "absmax",       "fixed,-2,2",
                                     "fixed,0,0", "fixed,1e38,1e38", "fixed,nan,1", "e4m3"};

const DType kDTypes[] = {DType::kF32,  DType::kF64,     DType::kF16,  DType::kBF16,
                         DType::kE4M3FN, DType::kE4M3FNUZ, DType::kE5M2, DType::kE5M2FNUZ,
                         DType::kBool, DType::kI8,      DType::kU8,   DType::kI16,
                         DType::kU16,  DType::kI32,     DType::kU32,  DType::kI64,
                         DType::kU64};

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "op_fuzz: contract break: %s\n", what.c_str());
  std::abort();
}

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  uint8_t U8() { return p_ < end_ ? *p_++ : 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(U8()) << (8 * i);
    return v;
  }
  std::string Str() {
    const size_t n = U8();
    std::string s;
    for (size_t i = 0; i < n; ++i) s.push_back(static_cast<char>(U8()));
    return s;
  }
  void Bytes(uint8_t* dst, size_t n) {
    const size_t have = std::min<size_t>(n, static_cast<size_t>(end_ - p_));
    if (have) std::memcpy(dst, p_, have);
    std::memset(dst + have, 0, n - have);
    p_ += have;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

template <typename T, size_t N>
const T& Pick(const T (&table)[N], size_t i) {
  return table[i % N];
}

// A value for flag `spec` from the type's table.
std::string TableValue(const FlagSpec& spec, uint8_t sel) {
  switch (spec.type) {
    case FlagType::kBool:
      return Pick(kBoolValues, sel);
    case FlagType::kInt:
      return Pick(kIntValues, sel);
    case FlagType::kFloat:
      return Pick(kFloatValues, sel);
    case FlagType::kString:
      if (!spec.choices.empty() && sel % 4 != 3) return spec.choices[sel % spec.choices.size()];
      return Pick(kStringExtras, sel / 4);
  }
  return "";
}

void Fill(Reader& r, uint8_t mode, Tensor* t) {
  const size_t n = t->num_elements(), bytes = t->num_bytes();
  uint8_t* p = t->data_as<uint8_t>();
  if (mode % 4 == 0 || bytes == 0) {
    r.Bytes(p, bytes);
  } else {
    std::mt19937 gen(r.U32());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-40f, 3.4e38f, -3e38f,
                              1e30f, 65504.0f, 500.0f, -100.0f};
    for (size_t i = 0; i < n; ++i) {
      double v = mode % 4 == 3 ? static_cast<double>(gen() % 4) : normal(gen);
      if (mode % 4 == 2 && gen() % 5 == 0) v = specials[gen() % 12];
      const DType d = t->dtype();
      switch (d) {
        case DType::kF32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); break;
        case DType::kF64: reinterpret_cast<double*>(p)[i] = v; break;
        case DType::kBF16:
          reinterpret_cast<uint16_t*>(p)[i] = F32ToBf16(static_cast<float>(v));
          break;
        case DType::kF16: reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(gen()); break;
        case DType::kBool: p[i] = static_cast<uint8_t>(gen() % 2); break;
        case DType::kI8:
          reinterpret_cast<int8_t*>(p)[i] = static_cast<int8_t>(
              std::isfinite(v) ? std::clamp(std::nearbyint(v * 20), -127.0, 127.0) : 0.0);
          break;
        case DType::kI32:
          reinterpret_cast<int32_t*>(p)[i] = std::isfinite(v) ? static_cast<int32_t>(
                                                                    std::clamp(v, -4.0, 64.0))
                                                              : 0;
          break;
        default:
          if (IsFp8(d)) {
            p[i] = EncodeFp8(static_cast<float>(v), *Fp8FormatOf(d), true);
          } else {
            for (size_t b = 0; b < DTypeSize(d); ++b) p[i * DTypeSize(d) + b] = static_cast<uint8_t>(gen());
          }
      }
    }
  }
  // BOOL tensors must hold 0 or 1, as the reader guarantees.
  if (t->dtype() == DType::kBool) {
    for (size_t i = 0; i < n; ++i) p[i] &= 1;
  }
}

struct Case {
  const OpDef* op = nullptr;
  std::vector<std::string> keys;
  SafetensorsFile in;
};

// Decodes a case; false when it breaks the caps (the input is skipped).
bool Decode(const uint8_t* data, size_t size, Case* c) {
  Reader r(data, size);
  const auto& ops = AllOps();
  c->op = &ops[r.U8() % ops.size()];
  const auto& flags = c->op->keys.flags();
  const int nkeys = r.U8() % 12;
  for (int i = 0; i < nkeys; ++i) {
    const uint8_t ns = r.U8();
    const FlagSpec* spec = ns < 0xF0 ? &flags[ns % flags.size()] : nullptr;
    const std::string name = spec ? spec->name : r.Str();
    const uint8_t vs = r.U8();
    const std::string value =
        vs < 0xF0 ? (spec ? TableValue(*spec, vs) : Pick(kIntValues, vs)) : r.Str();
    c->keys.push_back(name + "=" + value);
  }
  const int ntensors = r.U8() % 8;
  size_t elements = 0;
  for (int i = 0; i < ntensors; ++i) {
    const uint8_t ns = r.U8();
    const std::string name = ns < 0xF0 ? Pick(kNames, ns) : r.Str();
    const DType dtype = Pick(kDTypes, r.U8());
    const int rank = r.U8() % 5;
    Shape shape;
    for (int d = 0; d < rank; ++d) {
      const uint8_t v = r.U8();
      shape.push_back(v < 0xC0 ? v % 65 : Pick(kHugeDims, v - 0xC0));
    }
    auto n = CheckedNumElements(shape, DTypeSize(dtype));
    if (!n.ok() || *n > kMaxInputElements) return false;
    // Enormous dimensions only in empty tensors: the data caps the work.
    if (*n > 0) {
      for (int64_t d : shape) {
        if (d > 520) return false;
      }
    }
    elements += *n;
    if (elements > kMaxInputElements) return false;
    auto t = Tensor::Create(dtype, shape);
    if (!t.ok()) return false;
    Fill(r, r.U8(), &*t);
    // A duplicate name is refused by the reader; keep the first.
    if (c->in.Find(name) == nullptr) c->in.tensors.emplace_back(name, std::move(*t));
  }
  return true;
}

bool IsBadRequest(const Status& s) { return ExitCodeOf(s) == 2; }

std::string Describe(const Case& c) {
  std::string s = "op " + c.op->name;
  for (const auto& k : c.keys) s += " " + k;
  for (const auto& [n, t] : c.in.tensors) {
    s += " | " + n + " " + std::string(DTypeName(t.dtype())) + " " + ShapeToString(t.shape());
  }
  return s;
}

Status Run(const Case& c, const std::vector<std::string>& keys, SafetensorsFile* out) {
  return RunOpOnTensors(c.op->name, c.in, keys, out);
}

Status RunOn(const Case& c, const SafetensorsFile& in, const std::vector<std::string>& keys,
             SafetensorsFile* out) {
  return RunOpOnTensors(c.op->name, in, keys, out);
}

// The value of key `name` as the op sees it (the last setting wins).
Result<Config> KeysOf(const Case& c, const std::vector<std::string>& keys) {
  return LoadConfig(c.op->keys, "", keys);
}

bool IsTileKey(const std::string& n) {
  return n == "tile_m" || n == "tile_k" || n == "tile_n" ||
         (n.size() > 8 && (n.rfind("wi_tile_", 0) == 0 || n.rfind("wo_tile_", 0) == 0));
}

// Tiles that are part of the numerics, not only of the schedule: TGMM's m
// tile is its in-kernel quantization tile (dout_quant_granularity=tile, and
// the MoE drhs batch_seq tiles with moe_bwd_inkernel_quant=true).
bool IsNumericTile(const Case& c, const Config& cfg, const std::string& n) {
  if (c.op->name == "tgmm") {
    return n == "tile_m" && cfg.GetString("dout_quant") != "none" &&
           cfg.GetString("dout_quant_granularity") == "tile";
  }
  if (c.op->name == "moe_forward" || c.op->name == "moe_backward") {
    return cfg.GetBool("moe_bwd_inkernel_quant") &&
           (n == "wi_tile_drhs_batch_seq" || n == "wo_tile_drhs_batch_seq");
  }
  return false;
}

// Whether the run with tile keys must give the bits of the run without the
// schedule-only ones (which are then dropped into `plain`).
bool ScheduleTilesGiven(const Case& c, std::vector<std::string>* plain) {
  auto cfg = LoadConfig(c.op->keys, "", c.keys);
  if (!cfg.ok()) Fail("keys that ran do not load");
  bool any = false;
  plain->clear();
  for (const auto& k : c.keys) {
    const std::string name = k.substr(0, k.find('='));
    if (IsTileKey(name) && !IsNumericTile(c, *cfg, name)) {
      any = true;
    } else {
      plain->push_back(k);
    }
  }
  return any;
}

// Below about -87 sigmoid(g) is on f32's subnormal grid and below about
// -104 it is 0, where the double reference is not: silu(g) and silu'(g) are
// then off by up to 4 subnormal steps times (|g| + 1) (docs/numerics.md),
// an absolute error that the relative terms of the SwiGLU bounds miss. Times
// |u| (and |da|) it can be far above them (silu(-130) * 1e30 is 4e-26 in
// double, 0 in f32).
double SubnormalSiluError(double g) { return (std::fabs(g) + 1) * std::ldexp(1.0, -146); }

// Whether element i of two same-shaped F32 / BF16 tensors are both NaN: NaN
// payloads and signs follow the order operations meet them, which the
// contract leaves open ("NaN stays NaN"), so two NaNs count as the same.
bool BothNaN(const Tensor& a, const Tensor& b, size_t i) {
  if (a.dtype() == DType::kF32) {
    return std::isnan(a.data_as<float>()[i]) && std::isnan(b.data_as<float>()[i]);
  }
  if (a.dtype() == DType::kBF16) {
    return std::isnan(Bf16ToF32(a.data_as<uint16_t>()[i])) &&
           std::isnan(Bf16ToF32(b.data_as<uint16_t>()[i]));
  }
  return false;
}

// The same outputs bit for bit, except that any NaN equals any NaN.
bool SameBits(const SafetensorsFile& a, const SafetensorsFile& b, std::string* why) {
  if (a.tensors.size() != b.tensors.size()) {
    *why = "different output counts";
    return false;
  }
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [an, at] = a.tensors[i];
    const auto& [bn, bt] = b.tensors[i];
    if (an != bn || at.dtype() != bt.dtype() || at.shape() != bt.shape()) {
      *why = "output '" + an + "' differs in name, dtype or shape";
      return false;
    }
    if (std::memcmp(at.data(), bt.data(), at.num_bytes()) == 0) continue;
    const size_t width = DTypeSize(at.dtype());
    for (size_t e = 0; e < at.num_elements(); ++e) {
      if (std::memcmp(at.data_as<uint8_t>() + e * width, bt.data_as<uint8_t>() + e * width,
                      width) != 0 &&
          !BothNaN(at, bt, e)) {
        *why = "output '" + an + "' differs at element " + std::to_string(e);
        return false;
      }
    }
  }
  return true;
}

// ---- The gmm family against the reference twin ----

double ValueAt(const Tensor& t, size_t i) {
  switch (t.dtype()) {
    case DType::kF32: return t.data_as<float>()[i];
    case DType::kBF16: return Bf16ToF32(t.data_as<uint16_t>()[i]);
    default: return NAN;
  }
}

// |x| of every operand (F32 / BF16 sign cleared, fp8 codes' sign bit cleared
// except the fnuz NaN 0x80, int8 magnitudes clamped to 127, scales |s|), so
// the reference on it gives sum |a b| per output element.
SafetensorsFile AbsInputs(const SafetensorsFile& in, bool drop_h) {
  SafetensorsFile out;
  for (const auto& [n, t] : in.tensors) {
    if (drop_h && n == "h") continue;
    auto copy = Tensor::Create(t.dtype(), t.shape());
    if (!copy.ok()) Fail("cannot copy an input");
    std::memcpy(copy->data(), t.data(), t.num_bytes());
    uint8_t* p = copy->data_as<uint8_t>();
    const size_t count = t.num_elements();
    if (n != "group_sizes") {
      for (size_t i = 0; i < count; ++i) {
        switch (t.dtype()) {
          case DType::kF32: p[4 * i + 3] &= 0x7F; break;
          case DType::kBF16: p[2 * i + 1] &= 0x7F; break;
          case DType::kE4M3FN:
          case DType::kE5M2: p[i] &= 0x7F; break;
          case DType::kE4M3FNUZ:
          case DType::kE5M2FNUZ:
            if (p[i] != 0x80) p[i] &= 0x7F;
            break;
          case DType::kI8: {
            const int v = static_cast<int8_t>(p[i]);
            p[i] = static_cast<uint8_t>(std::min(std::abs(v), 127));
            break;
          }
          default: break;
        }
      }
    }
    out.tensors.emplace_back(n, std::move(*copy));
  }
  return out;
}

double Gamma(double r) {
  const double u = std::ldexp(1.0, -24);
  return r * u < 0.5 ? r * u / (1 - r * u) + 4 * u : INFINITY;
}

// |fast - ref| <= bound element-wise where the bound is finite and small
// enough that f32 cannot overflow.
void ExpectWithin(const Case& c, const std::string& name, const Tensor& fast,
                  const Tensor& ref, const std::vector<double>& bound) {
  if (fast.shape() != ref.shape() || fast.dtype() != ref.dtype()) {
    Fail(Describe(c) + ": output '" + name + "' is " + ShapeToString(fast.shape()) +
         " but the reference's is " + ShapeToString(ref.shape()));
  }
  for (size_t i = 0; i < fast.num_elements(); ++i) {
    // Compared where the bound is finite and the result is not near the f32
    // overflow threshold (one side may round to FLT_MAX, the other to inf).
    const double b = bound[i];
    const double f = ValueAt(fast, i), r = ValueAt(ref, i);
    if (!(b < 1e37) || !(std::fabs(r) < 1e38) || f == r) continue;
    if (!(std::fabs(f - r) <= b)) {
      char buf[200];
      std::snprintf(buf, sizeof(buf), ": '%s'[%zu] fast %.9g, reference %.9g, bound %.3g",
                    name.c_str(), i, f, r, b);
      Fail(Describe(c) + buf);
    }
  }
}

void CheckGmmFamily(const Case& c, const SafetensorsFile& fast) {
  const std::string& op = c.op->name;
  auto cfg = KeysOf(c, c.keys);
  if (!cfg.ok()) Fail("keys that ran do not load");
  if (cfg->GetBool("reference")) return;  // the twin itself ran
  std::vector<std::string> ref_keys = c.keys;
  ref_keys.push_back("reference=true");
  SafetensorsFile ref;
  const Status rs = Run(c, ref_keys, &ref);
  if (!rs.ok()) Fail(Describe(c) + ": the fast path ran but the reference fails: " + rs.ToString());
  // Schedule tiles never change the bits.
  if (std::vector<std::string> plain_keys; ScheduleTilesGiven(c, &plain_keys)) {
    SafetensorsFile plain;
    const Status ps = Run(c, plain_keys, &plain);
    std::string why;
    if (!ps.ok()) Fail(Describe(c) + ": runs with tile keys but not without: " + ps.ToString());
    if (!SameBits(fast, plain, &why)) Fail(Describe(c) + ": tile keys change the bits: " + why);
  }
  // dLHS from codes: mode bf16 (dequantized tile by tile) and mode fake_qat
  // (the BF16 copy) give the same bits, by contract (gmm.h).
  const std::string mode = cfg->GetString("mode");
  if (op == "dlhs" && c.in.Find("rhs_codes") != nullptr && (mode == "bf16" || mode == "fake_qat")) {
    std::vector<std::string> other;
    for (const auto& k : c.keys) {
      if (k.rfind("fp8_dtype=", 0) != 0) other.push_back(k);
    }
    other.push_back(mode == "bf16" ? "mode=fake_qat" : "mode=bf16");
    SafetensorsFile twin;
    const Status ts = Run(c, other, &twin);
    std::string why;
    if (!ts.ok()) Fail(Describe(c) + ": dlhs from codes runs in one of bf16 / fake_qat only: " + ts.ToString());
    if (!SameBits(fast, twin, &why)) Fail(Describe(c) + ": dlhs bf16 from codes != fake_qat: " + why);
  }
  const std::string epilogue = op == "tgmm" ? "none" : cfg->GetString("epilogue");
  std::vector<std::string> abs_keys = ref_keys;
  abs_keys.insert(abs_keys.end(), {"out_dtype=f32", "check_finite=false"});
  if (op != "tgmm") abs_keys.push_back("epilogue=none");
  const std::string out_name = op == "gmm" ? "out" : op == "dlhs" ? "dlhs" : "drhs";
  SafetensorsFile habs_file;
  if (!RunOn(c, AbsInputs(c.in, epilogue == "dswiglu"), abs_keys, &habs_file).ok()) return;
  const Tensor& habs = *habs_file.Find(out_name);
  int64_t reduction = 0;
  if (op == "gmm") {
    reduction = c.in.Find("lhs")->dim(1);
  } else if (op == "dlhs") {
    reduction = c.in.Find("dout")->dim(1);
  } else {
    reduction = c.in.Find("lhs")->dim(0);
  }
  const bool bf16 = cfg->GetString("out_dtype") == "bf16";
  std::vector<double> hb(habs.num_elements());
  for (size_t i = 0; i < hb.size(); ++i) hb[i] = Gamma(static_cast<double>(reduction)) * ValueAt(habs, i) + 1e-30;
  // The quantized forward computes (sum_k qa qw) * s_a * s_w in f32, left
  // to right as XLA does (docs/design.md §3.3); the reference sums in double. The
  // intermediate (sum_k qa qw) * s_a is about sum_k |x_k| |qw_k| <= qmax *
  // sum_k |x_k|: where that can pass FLT_MAX the f32 result is +-inf by
  // contract although the exact product is finite, so the row is not compared.
  // (A fixed calibration can round a value up to the smallest code, at most
  // twice it: 2 qmax sum |x| bounds every calibration.)
  if (op == "gmm" && (mode == "native_fp8" || mode == "int8")) {
    const QuantDType qd =
        mode == "int8" ? QuantDType::kInt8 : *ParseQuantDType(cfg->GetString("fp8_dtype"));
    const Tensor& lhs = *c.in.Find("lhs");
    const int64_t rows = lhs.dim(0), kk = lhs.dim(1), n = habs.dim(1);
    for (int64_t i = 0; i < rows; ++i) {
      double l1 = 0;
      for (int64_t k = 0; k < kk; ++k) l1 += std::fabs(ValueAt(lhs, static_cast<size_t>(i * kk + k)));
      if (!(2 * QuantMax(qd) * l1 < 1e38)) {
        std::fill(hb.begin() + i * n, hb.begin() + (i + 1) * n, INFINITY);
      }
    }
  }
  auto widen = [&](std::vector<double> b, const Tensor& r) {
    if (bf16) {
      for (size_t i = 0; i < b.size(); ++i) b[i] = 2 * b[i] + std::ldexp(std::fabs(ValueAt(r, i)), -7);
    }
    return b;
  };
  const Tensor* ref_out = ref.Find(out_name);
  const Tensor* fast_out = fast.Find(out_name);
  if (ref_out == nullptr || fast_out == nullptr) Fail(Describe(c) + ": an output is missing");
  if (epilogue == "none") {
    ExpectWithin(c, out_name, *fast_out, *ref_out, widen(hb, *ref_out));
    return;
  }
  if (epilogue == "swiglu") {
    const Tensor* fh = fast.Find("h");
    const Tensor* rh = ref.Find("h");
    if (fh == nullptr || rh == nullptr) Fail(Describe(c) + ": 'h' is missing");
    ExpectWithin(c, "h", *fh, *rh, widen(hb, *rh));
    const int64_t m = rh->dim(0), n = rh->dim(1), f = n / 2;
    std::vector<double> b(static_cast<size_t>(m * f));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < f; ++j) {
        const double g = ValueAt(*rh, i * n + j), u = ValueAt(*rh, i * n + f + j);
        const double eg = hb[i * n + j], eu = hb[i * n + f + j];
        const double s = 1 / (1 + std::exp(-g));
        const double ds = std::fabs(s * (1 + g * (1 - s)));
        const double v = std::fabs(g * s * u);
        // bf16 h is the rounded pre-activation: its own error is part of g, u.
        const double hr = bf16 ? std::ldexp(std::fabs(g) + std::fabs(u), -7) : 0;
        b[i * f + j] = ds * std::fabs(u) * (eg + hr) + std::fabs(g * s) * (eu + hr) + 1e-5 * v +
                       SubnormalSiluError(g) * std::fabs(u) + 1e-30;
        if (bf16) b[i * f + j] = 2 * b[i * f + j] + std::ldexp(v, -7);
      }
    }
    ExpectWithin(c, "out", *fast_out, *ref_out, b);
    return;
  }
  // dswiglu: da from the reference without the epilogue, then the bound of
  // kernels/gmm_test.cc carried through the dSwiGLU formulas.
  SafetensorsFile da_file, no_h;
  for (const auto& [n, t] : c.in.tensors) {
    if (n == "h") continue;
    auto copy = Tensor::Create(t.dtype(), t.shape());
    if (!copy.ok()) Fail("cannot copy an input");
    std::memcpy(copy->data(), t.data(), t.num_bytes());
    no_h.tensors.emplace_back(n, std::move(*copy));
  }
  std::vector<std::string> da_keys = ref_keys;
  da_keys.insert(da_keys.end(), {"epilogue=none", "out_dtype=f32", "check_finite=false"});
  if (!RunOn(c, no_h, da_keys, &da_file).ok()) Fail(Describe(c) + ": dlhs without dswiglu fails");
  const Tensor& da = *da_file.Find("dlhs");
  const Tensor& h = *c.in.Find("h");
  const int64_t m = da.dim(0), k = da.dim(1);
  std::vector<double> b(static_cast<size_t>(m * 2 * k));
  const auto hval = [&](int64_t i) {
    return h.dtype() == DType::kF32 ? static_cast<double>(h.data_as<float>()[i])
                                    : static_cast<double>(Bf16ToF32(h.data_as<uint16_t>()[i]));
  };
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      const double eda = hb[i * k + j];
      const double g = hval(i * 2 * k + j), u = hval(i * 2 * k + k + j);
      const double a = ValueAt(da, i * k + j);
      const double s = 1 / (1 + std::exp(-g)), ds = s * (1 + g * (1 - s));
      for (int half = 0; half < 2; ++half) {
        const double coef = half == 0 ? std::fabs(u * ds) : std::fabs(g * s);
        const double v = std::fabs(a) * coef;
        const double terms = half == 0 ? std::fabs(u) * (1 + std::fabs(g)) : std::fabs(g);
        const double sub = SubnormalSiluError(g) * std::fabs(a) * (half == 0 ? std::fabs(u) + 1 : 1);
        double bound = coef * eda + 1e-5 * std::fabs(a) * terms + sub + 1e-30;
        if (bf16) bound = 2 * bound + std::ldexp(v, -7);
        b[i * 2 * k + half * k + j] = bound;
      }
    }
  }
  ExpectWithin(c, out_name, *fast_out, *ref_out, b);
}

// ---- cast, decode, quantize against their scalar / plain-loop twins ----

void CheckCast(const Case& c, const SafetensorsFile& out) {
  auto cfg = KeysOf(c, c.keys);
  const Tensor& x = *c.in.Find("x");
  const Tensor& y = *out.Find("y");
  const std::string& format = cfg->GetString("format");
  const bool saturate = cfg->GetBool("saturate");
  const float* xs = x.data_as<float>();
  for (size_t i = 0; i < x.num_elements(); ++i) {
    if (format == "bf16") {
      const float bmax = Bf16ToF32(0x7F7F);
      const float v = saturate && !std::isnan(xs[i]) ? std::fmin(std::fmax(xs[i], -bmax), bmax) : xs[i];
      if (y.data_as<uint16_t>()[i] != F32ToBf16(v)) Fail(Describe(c) + ": cast bf16 differs from F32ToBf16");
    } else if (y.data_as<uint8_t>()[i] != EncodeFp8(xs[i], *ParseFp8Format(format), saturate)) {
      Fail(Describe(c) + ": cast differs from EncodeFp8 at " + std::to_string(i));
    }
  }
}

void CheckDecode(const Case& c, const SafetensorsFile& out) {
  auto cfg = KeysOf(c, c.keys);
  const Tensor& y = *c.in.Find("y");
  const Tensor& x = *out.Find("x");
  if (x.shape() != y.shape()) Fail(Describe(c) + ": decode changed the shape");
  for (size_t i = 0; i < y.num_elements(); ++i) {
    float want;
    if (y.dtype() == DType::kBF16) {
      want = Bf16ToF32(y.data_as<uint16_t>()[i]);
    } else {
      const Fp8Format f = IsFp8(y.dtype()) ? *Fp8FormatOf(y.dtype())
                                           : *ParseFp8Format(cfg->GetString("format"));
      want = DecodeFp8(y.data_as<uint8_t>()[i], f);
    }
    if (std::bit_cast<uint32_t>(want) != std::bit_cast<uint32_t>(x.data_as<float>()[i])) {
      Fail(Describe(c) + ": decode differs from the scalar decode at " + std::to_string(i));
    }
  }
}

void CheckQuantize(const Case& c, const SafetensorsFile& out) {
  auto cfg = KeysOf(c, c.keys);
  const Tensor& x = *c.in.Find("x");
  const Tensor& q = *out.Find("q");
  const Tensor& scale = *out.Find("scale");
  const QuantDType dt = *ParseQuantDType(cfg->GetString("dtype"));
  // The op reads the scale arithmetic from its own key: the reference must get it too.
  const Calibration cal = Calibration::Parse(cfg->GetString("calibration"))
                              ->With(*ParseScaleArithmetic(cfg->GetString("scale_arithmetic")));
  const std::string& g = cfg->GetString("granularity");
  std::vector<uint8_t> rq(q.num_bytes() + 1);
  std::vector<float> rs(scale.num_elements() + 1);
  Status s;
  if (g == "tensor") {
    s = reference::QuantizeTensor(x.data_as<float>(), static_cast<int64_t>(x.num_elements()), dt,
                                  cal, rq.data(), rs.data());
  } else if (g == "row") {
    s = reference::QuantizeRows(x.data_as<float>(), x.dim(0), x.dim(1), x.dim(0),
                                cfg->GetInt("block_size"), dt, cal, rq.data(), rs.data());
  } else {
    const int r = x.rank();
    s = reference::QuantizeChannels(x.data_as<float>(), r == 3 ? x.dim(0) : 1, x.dim(r - 2),
                                    x.dim(r - 1), dt, cal, rq.data(), rs.data());
  }
  if (!s.ok()) Fail(Describe(c) + ": the reference quantizer fails: " + s.ToString());
  if (std::memcmp(rq.data(), q.data(), q.num_bytes()) != 0 ||
      std::memcmp(rs.data(), scale.data(), scale.num_bytes()) != 0) {
    Fail(Describe(c) + ": quantize differs from the reference quantizer");
  }
}

void CheckMoeTiles(const Case& c, const SafetensorsFile& out) {
  std::vector<std::string> plain_keys;
  if (!ScheduleTilesGiven(c, &plain_keys)) return;
  SafetensorsFile plain;
  const Status s = Run(c, plain_keys, &plain);
  if (!s.ok()) Fail(Describe(c) + ": runs with tile keys but not without: " + s.ToString());
  std::string why;
  if (!SameBits(out, plain, &why)) Fail(Describe(c) + ": tile keys change the bits: " + why);
}

}  // namespace
}  // namespace fp8moe::cli

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fp8moe::SetMemoryCap(fp8moe::cli::kFuzzMemoryCap, "the op fuzzer's cap");
  omp_set_num_threads(2);
  return 0;
}

namespace fp8moe::cli {
namespace {

void RunCase(const Case& c);

}  // namespace
}  // namespace fp8moe::cli

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8moe;
  using namespace fp8moe::cli;
  Case c;
  if (!Decode(data, size, &c)) return -1;
  RunCase(c);
  ReleaseGmmScratch();  // the next input starts from the same state
  return 0;
}

namespace fp8moe::cli {
namespace {

void RunCase(const Case& c) {
  SafetensorsFile out;
  const Status s = Run(c, c.keys, &out);
  // OP_FUZZ_STATS=1: one line per input, to see what a corpus reaches.
  static const bool stats = std::getenv("OP_FUZZ_STATS") != nullptr;
  if (stats) std::fprintf(stderr, "op_fuzz: %s %s\n", c.op->name.c_str(), s.ok() ? "ok" : std::string(StatusCodeName(s.code())).c_str());
  // OP_FUZZ_DUMP=file.safetensors: the input's tensors, to replay a case
  // with `fp8moe op NAME KEYS --in file.safetensors` (the keys: Describe).
  if (const char* dump = std::getenv("OP_FUZZ_DUMP"); dump != nullptr) {
    const Status w = WriteSafetensors(dump, c.in);
    std::fprintf(stderr, "op_fuzz: %s -> %s\n", Describe(c).c_str(),
                 w.ok() ? dump : w.ToString().c_str());
  }
  if (!s.ok()) {
    if (!IsBadRequest(s)) Fail(Describe(c) + ": exit code 1 for " + s.ToString());
    if (s.message().empty()) Fail(Describe(c) + ": an error without a message");
    return;
  }
  // The outputs must be a writable file that reads back the same.
  auto bytes = SerializeSafetensors(out);
  if (!bytes.ok()) Fail(Describe(c) + ": outputs do not serialize: " + bytes.status().ToString());
  auto back = ParseSafetensors(bytes->data(), bytes->size());
  std::string why;
  if (!back.ok() || !SameBits(out, *back, &why)) Fail(Describe(c) + ": outputs do not read back");
  const std::string& op = c.op->name;
  if (op == "gmm" || op == "dlhs" || op == "tgmm") {
    CheckGmmFamily(c, out);
  } else if (op == "cast") {
    CheckCast(c, out);
  } else if (op == "decode") {
    CheckDecode(c, out);
  } else if (op == "quantize") {
    CheckQuantize(c, out);
  } else if (op == "moe_forward" || op == "moe_backward") {
    CheckMoeTiles(c, out);
  }
}

}  // namespace
}  // namespace fp8moe::cli
