// Hostile arguments for Gmm, GmmDlhs and Tgmm, fast and reference alike:
// tiles past kMaxGmmTile are refused with the bound in the message; the
// largest allowed tiles give the default's bits (no overflow in the work
// planning); zero-element calls with enormous other dimensions return at
// once; views whose dimensions multiply past the int64 range are refused.
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "fp8moe/gmm.h"

namespace fp8moe {
namespace {

constexpr int64_t kHuge = int64_t{1} << 40;

Tensor Make(DType d, Shape s) { return std::move(Tensor::Zeros(d, std::move(s))).value(); }

// The context-free entry points (Gmm and friends are overloaded with the
// Context& ones, so the pointer types are spelled out).
using GmmFn = Status (*)(const GmmOptions&, const ConstTensorView&, const ConstTensorView&,
                         const ConstTensorView*, const ConstTensorView&, const TensorView&,
                         const TensorView*);
using DlhsFn = Status (*)(const GmmOptions&, const ConstTensorView&, const ConstTensorView&,
                          const ConstTensorView*, const ConstTensorView&, const TensorView&,
                          const ConstTensorView*);
using TgmmFn = Status (*)(const GmmOptions&, const TgmmQuant&, const ConstTensorView&,
                          const ConstTensorView&, const ConstTensorView&, const TensorView&);
struct Api {
  const char* name;
  GmmFn gmm;
  DlhsFn dlhs;
  TgmmFn tgmm;
};
const Api kApis[] = {{"fast", Gmm, GmmDlhs, Tgmm},
                     {"reference", reference::Gmm, reference::GmmDlhs, reference::Tgmm}};

// The reproducer: lhs [[1], [1]], rhs [[[1]], [[2]]], one row per group.
struct Tiny {
  Tensor lhs = Make(DType::kF32, {2, 1}), rhs = Make(DType::kF32, {2, 1, 1});
  Tensor gs = Make(DType::kI32, {2}), out = Make(DType::kF32, {2, 1});
  Tiny() {
    lhs.data_as<float>()[0] = lhs.data_as<float>()[1] = 1.0f;
    rhs.data_as<float>()[0] = 1.0f;
    rhs.data_as<float>()[1] = 2.0f;
    gs.data_as<int32_t>()[0] = gs.data_as<int32_t>()[1] = 1;
  }
};

TEST(GmmRobustness, TilesAboveTheBoundAreRefused) {
  const int64_t bad[] = {kMaxGmmTile + 2, 100000000, int64_t{1} << 62,
                         std::numeric_limits<int64_t>::max() - 1};
  for (const Api& api : kApis) {
    for (int axis = 0; axis < 3; ++axis) {
      for (int64_t v : bad) {
        Tiny t;
        GmmOptions o;
        o.mode = GmmMode::kF32;
        (axis == 0 ? o.tiles.m : axis == 1 ? o.tiles.k : o.tiles.n) = v;
        const Status s = api.gmm(o, t.lhs.view(), t.rhs.view(), nullptr, t.gs.view(),
                                 t.out.view(), nullptr);
        ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << api.name << " " << v;
        EXPECT_NE(s.message().find("1048576"), std::string::npos) << s.message();
        Tensor drhs = Make(DType::kF32, {2, 1, 1});
        const Status st = api.tgmm(o, {}, t.lhs.view(), t.lhs.view(), t.gs.view(), drhs.view());
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << api.name << " tgmm " << v;
      }
    }
  }
}

TEST(GmmRobustness, LargestTilesGiveTheDefaultBits) {
  for (const Api& api : kApis) {
    Tiny def, big;
    GmmOptions o;
    o.mode = GmmMode::kF32;
    ASSERT_TRUE(api.gmm(o, def.lhs.view(), def.rhs.view(), nullptr, def.gs.view(),
                        def.out.view(), nullptr).ok());
    EXPECT_EQ(def.out.data_as<float>()[0], 1.0f) << api.name;
    EXPECT_EQ(def.out.data_as<float>()[1], 2.0f) << api.name;
    o.tiles = {kMaxGmmTile, kMaxGmmTile, kMaxGmmTile};
    ASSERT_TRUE(api.gmm(o, big.lhs.view(), big.rhs.view(), nullptr, big.gs.view(),
                        big.out.view(), nullptr).ok());
    EXPECT_EQ(std::memcmp(def.out.data(), big.out.data(), def.out.num_bytes()), 0) << api.name;
    // TGMM with the in-kernel quantization tile at the bound.
    Tensor d1 = Make(DType::kF32, {2, 1, 1}), d2 = Make(DType::kF32, {2, 1, 1});
    TgmmQuant q;
    q.dout_dtype = QuantDType::kE5M2;
    q.per_group = false;
    GmmOptions ot;
    ot.mode = GmmMode::kF32;
    ASSERT_TRUE(api.tgmm(ot, q, def.lhs.view(), def.lhs.view(), def.gs.view(), d1.view()).ok());
    ot.tiles = {kMaxGmmTile, kMaxGmmTile, kMaxGmmTile};
    ASSERT_TRUE(api.tgmm(ot, q, def.lhs.view(), def.lhs.view(), def.gs.view(), d2.view()).ok());
    EXPECT_EQ(std::memcmp(d1.data(), d2.data(), d1.num_bytes()), 0) << api.name;
  }
}

// No output elements: every call returns at once, however large the other
// dimensions (before the fix these looped over 2^40 rows or reduction steps).
TEST(GmmRobustness, ZeroElementCallsWithHugeDimensionsReturnAtOnce) {
  for (const Api& api : kApis) {
    SCOPED_TRACE(api.name);
    Tensor gs = Make(DType::kI32, {1});
    GmmOptions bf;
    // gmm mode=fake_qat with lhs BF16 [0, 2^40] and rhs codes [1, 2^40, 0].
    Tensor lhs = Make(DType::kBF16, {0, kHuge});
    Tensor codes = Make(DType::kE4M3FN, {1, kHuge, 0}), scale = Make(DType::kF32, {1, 0});
    Tensor out = Make(DType::kF32, {0, 0});
    bf.mode = GmmMode::kFakeQat;
    const ConstTensorView sv = scale.view();
    EXPECT_TRUE(api.gmm(bf, lhs.view(), codes.view(), &sv, gs.view(), out.view(), nullptr).ok());
    // gmm with 2^40 rows of width 0 and group sizes covering 2^31 - 1 rows.
    gs.data_as<int32_t>()[0] = std::numeric_limits<int32_t>::max();
    GmmOptions f32;
    f32.mode = GmmMode::kF32;
    f32.tiles.m = 1;
    Tensor tall = Make(DType::kF32, {kHuge, 0}), w = Make(DType::kF32, {1, 0, 0});
    Tensor tall_out = Make(DType::kF32, {kHuge, 0});
    EXPECT_TRUE(api.gmm(f32, tall.view(), w.view(), nullptr, gs.view(), tall_out.view(), nullptr).ok());
    GmmOptions native;
    native.mode = GmmMode::kNativeFp8;
    Tensor c0 = Make(DType::kE4M3FN, {1, 0, 0});
    Tensor s0t = Make(DType::kF32, {1, 0});
    const ConstTensorView s0 = s0t.view();
    EXPECT_TRUE(api.gmm(native, tall.view(), c0.view(), &s0, gs.view(), tall_out.view(), nullptr).ok());
    // dlhs: dout [2^40, 0] x rhs [1, 0, 0]^T -> [2^40, 0].
    EXPECT_TRUE(api.dlhs(f32, tall.view(), w.view(), nullptr, gs.view(), tall_out.view(), nullptr).ok());
    // tgmm: lhs [2^40, 0], dout [2^40, 0] -> drhs [1, 0, 0], in-kernel quantized.
    TgmmQuant q;
    q.dout_dtype = QuantDType::kE4M3FN;
    q.per_group = false;
    Tensor drhs = Make(DType::kF32, {1, 0, 0});
    EXPECT_TRUE(api.tgmm(f32, q, tall.view(), tall.view(), gs.view(), drhs.view()).ok());
    // tgmm: lhs [0, 2^40] -> drhs [1, 2^40, 0] (empty).
    gs.data_as<int32_t>()[0] = 0;
    Tensor wide = Make(DType::kBF16, {0, kHuge}), dout = Make(DType::kBF16, {0, 0});
    Tensor drhs2 = Make(DType::kF32, {1, kHuge, 0});
    EXPECT_TRUE(api.tgmm(GmmOptions{}, {}, wide.view(), dout.view(), gs.view(), drhs2.view()).ok());
  }
}

TEST(GmmRobustness, ViewsPastTheInt64RangeAreRefused) {
  // A view is not checked when it is made; the kernels refuse shapes whose
  // nonzero dimensions multiply out of range, and negative dimensions.
  for (const Api& api : kApis) {
    Tensor gs = Make(DType::kI32, {1});
    GmmOptions o;
    o.mode = GmmMode::kF32;
    ConstTensorView lhs{nullptr, DType::kF32, {0, kHuge}};
    ConstTensorView rhs{nullptr, DType::kF32, {1, kHuge, kHuge}};
    TensorView out{nullptr, DType::kF32, {0, kHuge}};
    Status s = api.gmm(o, lhs, rhs, nullptr, gs.view(), out, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    ConstTensorView neg{nullptr, DType::kF32, {-1, 4}};
    s = api.gmm(o, neg, rhs, nullptr, gs.view(), out, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  }
}

}  // namespace
}  // namespace fp8moe
