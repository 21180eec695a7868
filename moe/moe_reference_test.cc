// Tests of the reference MoE layer (moe/reference/): its gradients against
// central finite differences of its own loss, routing and group sizes on a
// hand-made example, every QAT mode against the f32 layer within stated
// bounds, and the STE mask of a fixed weight calibration.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fp8moe/moe.h"
#include "fp8moe/moe_config.h"
#include "kernels/gmm_problem.h"

namespace fp8moe {
namespace {

size_t Idx(int64_t i) { return static_cast<size_t>(i); }

// A tensor of uniform values in [lo, hi).
Tensor Uniform(const Shape& shape, double lo, double hi, std::mt19937* rng) {
  Tensor t = Tensor::Create(DType::kF32, shape).value();
  std::uniform_real_distribution<double> dist(lo, hi);
  float* v = t.data_as<float>();
  for (size_t i = 0; i < t.num_elements(); ++i) {
    v[i] = static_cast<float>(dist(*rng));
  }
  return t;
}

// The layer's inputs, owned: x [T, D], router [D, E], wi [E, D, 2F],
// wo [E, F, D], dy [T, D].
struct Inputs {
  Tensor x, router, wi, wo, dy;
  MoeWeights weights() { return {router.view(), wi.view(), wo.view()}; }
};

// Random inputs; the weights scaled so every activation stays O(1).
Inputs RandomInputs(int64_t t, int64_t d, int64_t f, int64_t e, double wscale,
                    uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs in;
  in.x = Uniform({t, d}, -1, 1, &rng);
  in.router = Uniform({d, e}, -1, 1, &rng);
  in.wi = Uniform({e, d, 2 * f}, -wscale, wscale, &rng);
  in.wo = Uniform({e, f, d}, -wscale, wscale, &rng);
  in.dy = Uniform({t, d}, -1, 1, &rng);
  return in;
}

MoeConfig Config(int64_t experts, int64_t k, DType dtype) {
  MoeConfig c;
  c.dtype = dtype;
  c.num_experts = experts;
  c.num_experts_per_tok = k;
  c.load_balance_loss_weight = 0.1;
  return c;
}

// The QAT modes' flags, on top of a config.
MoeConfig FakeQat(MoeConfig c) {
  c.fp8_moe_fake_quant = true;
  return c;
}
MoeConfig Native(MoeConfig c) {
  c.fp8_moe_fake_quant = true;
  c.fp8_moe_native_fwd = true;
  c.fp8_fake_quant_hoist = Fp8FakeQuantHoist::kGather8;
  return c;
}
MoeConfig Fp8Full(MoeConfig c) {
  c.quantization = MoeQuantization::kFp8Full;
  c.use_qwix_quantization = true;
  return c;
}

// The smallest gap over the tokens between a chosen and an unchosen choice
// score (the k-th and (k+1)-th of the open experts) and, with routing
// groups, between the last kept and the first dropped group's score: a
// perturbation that moves the scores by less keeps every choice.
double TopKMargin(const Inputs& in, const MoeConfig& c) {
  const int64_t t_n = in.x.dim(0), d_n = in.x.dim(1), e_n = in.router.dim(1);
  const int64_t k = c.num_experts_per_tok;
  const bool sigmoid = c.routed_score_func == RoutedScoreFunc::kSigmoid;
  double margin = INFINITY;
  for (int64_t t = 0; t < t_n; ++t) {
    std::vector<double> l(Idx(e_n), 0.0);
    for (int64_t e = 0; e < e_n; ++e) {
      for (int64_t d = 0; d < d_n; ++d) {
        l[Idx(e)] += static_cast<double>(in.x.data_as<float>()[t * d_n + d]) *
                     in.router.data_as<float>()[d * e_n + e];
      }
      if (sigmoid) l[Idx(e)] = 1 / (1 + std::exp(-l[Idx(e)]));
    }
    std::vector<double> open = l;
    if (c.n_routing_groups != -1) {
      const int64_t g_n = c.n_routing_groups, per = e_n / g_n;
      std::vector<std::pair<double, int64_t>> groups;
      for (int64_t g = 0; g < g_n; ++g) {
        std::vector<double> v(l.begin() + g * per, l.begin() + (g + 1) * per);
        std::sort(v.begin(), v.end(), std::greater<>());
        groups.push_back({v[0] + v[1], g});
      }
      std::sort(groups.begin(), groups.end(), std::greater<>());
      const int64_t keep = c.topk_routing_group;
      if (keep < g_n) margin = std::min(margin, groups[Idx(keep - 1)].first - groups[Idx(keep)].first);
      open.clear();
      for (int64_t j = 0; j < keep; ++j) {
        const int64_t g = groups[Idx(j)].second;
        open.insert(open.end(), l.begin() + g * per, l.begin() + (g + 1) * per);
      }
    }
    std::sort(open.begin(), open.end(), std::greater<>());
    if (k < static_cast<int64_t>(open.size())) {
      margin = std::min(margin, open[Idx(k - 1)] - open[Idx(k)]);
    }
  }
  return margin;
}

float MaxAbs(const Tensor& t) {
  float m = 0;
  for (size_t i = 0; i < t.num_elements(); ++i) {
    m = std::max(m, std::fabs(t.data_as<float>()[i]));
  }
  return m;
}

// max |got - want| / max |want|: the error relative to the tensor's scale.
double RelErr(const Tensor& got, const Tensor& want) {
  double err = 0;
  for (size_t i = 0; i < want.num_elements(); ++i) {
    const double g = got.data_as<float>()[i], w = want.data_as<float>()[i];
    if (!std::isfinite(g)) return INFINITY;
    err = std::max(err, std::fabs(g - w));
  }
  return err / MaxAbs(want);
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.num_bytes() == b.num_bytes() &&
         std::equal(a.data_as<uint8_t>(), a.data_as<uint8_t>() + a.num_bytes(),
                    b.data_as<uint8_t>());
}

// ---- (1) Gradients against central finite differences ----

// Every gradient of the reference (T = 7, D = 6, F = 5) against central
// differences of its loss, for `config` (E and k are its).
void ExpectFiniteDifferences(const MoeConfig& config, const std::string& what) {
  const int64_t t_n = 7, d_n = 6, f_n = 5, e_n = config.num_experts;
  // A perturbation of h = 1e-4 moves a logit by at most h * D * max|x or Wr|
  // = 6e-4; a margin of 0.02 keeps every top-k set (and so group_sizes and
  // the aux loss's f_e) fixed under every perturbation.
  Inputs in;
  const ConstTensorView* no_dy = nullptr;
  for (uint32_t seed = 1;; ++seed) {
    ASSERT_LT(seed, 2000u) << "no seed gives a routing margin of 0.02 and rows for every expert";
    in = RandomInputs(t_n, d_n, f_n, e_n, 0.7, seed);
    if (TopKMargin(in, config) <= 0.02) continue;
    // Every expert should see rows, or its weights' gradients are trivially 0.
    Result<reference::MoeReferenceResult> r =
        reference::MoeLayer(config, in.x.view(), in.weights(), no_dy);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const int32_t* sizes = r->group_sizes.data_as<int32_t>();
    if (std::all_of(sizes, sizes + e_n, [](int32_t n) { return n > 0; })) break;
  }
  const ConstTensorView dy = in.dy.view();
  Result<reference::MoeReferenceResult> base =
      reference::MoeLayer(config, in.x.view(), in.weights(), &dy);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  const auto loss = [&]() {
    Result<reference::MoeReferenceResult> r =
        reference::MoeLayer(config, in.x.view(), in.weights(), &dy);
    EXPECT_TRUE(r.ok());
    return r->loss;
  };
  struct Param {
    const char* name;
    Tensor* value;
    const Tensor* grad;
  };
  for (const Param& p :
       {Param{"x", &in.x, &base->dx},
        Param{"router", &in.router, &base->drouter},
        Param{"wi", &in.wi, &base->dwi}, Param{"wo", &in.wo, &base->dwo}}) {
    // The f32 gradient is exact to ~6e-8 of its scale and the central
    // difference to O(h^2) ~ 1e-8 (observed: at most 4e-8 of the scale), so
    // 1e-6 of the scale separates any real error from rounding (a wrong sign
    // on the aux loss's term alone gives 2e-1 on the router).
    const double tol = 1e-6 * MaxAbs(*p.grad);
    ASSERT_GT(MaxAbs(*p.grad), 1e-3) << p.name;
    float* v = p.value->data_as<float>();
    for (size_t i = 0; i < p.value->num_elements(); ++i) {
      const float v0 = v[i];
      const float h = 1e-4f * std::max(1.0f, std::fabs(v0));
      // The steps as the f32 storage holds them: exact in the denominator.
      const float up = v0 + h, down = v0 - h;
      v[i] = up;
      const double l_up = loss();
      v[i] = down;
      const double l_down = loss();
      v[i] = v0;
      const double fd = (l_up - l_down) /
                        (static_cast<double>(up) - static_cast<double>(down));
      EXPECT_NEAR(p.grad->data_as<float>()[i], fd, tol)
          << p.name << "[" << i << "], " << what;
    }
  }
}

class MoeReferenceGradTest : public ::testing::TestWithParam<bool> {};

TEST_P(MoeReferenceGradTest, MatchesFiniteDifferences) {
  MoeConfig config = Config(4, 2, DType::kF32);
  config.norm_topk_prob = GetParam();
  ExpectFiniteDifferences(config, GetParam() ? "norm_topk_prob" : "plain");
}

INSTANTIATE_TEST_SUITE_P(NormTopkProb, MoeReferenceGradTest, ::testing::Bool());

// The routing functions (routed_score_func, routed_scaling_factor,
// n_routing_groups / topk_routing_group with norm_topk_prob): the same
// check through the sigmoid's and the scaling's gradients. Routing groups
// need E = 8 (4 groups of 2, 2 kept) so that a group choice matters.
TEST(MoeReferenceGradTest, RoutingFunctionsMatchFiniteDifferences) {
  struct Variant {
    const char* name;
    int64_t e, k;
    RoutedScoreFunc func;
    bool norm;
    double scaling;
    int64_t groups, keep;
  };
  for (const Variant& v : {Variant{"softmax scaled", 4, 2, RoutedScoreFunc::kSoftmax, true, 2.5, -1, -1},
                           Variant{"sigmoid", 4, 2, RoutedScoreFunc::kSigmoid, false, 1.0, -1, -1},
                           Variant{"sigmoid norm scaled", 4, 2, RoutedScoreFunc::kSigmoid, true, 2.5, -1, -1},
                           Variant{"sigmoid groups", 8, 3, RoutedScoreFunc::kSigmoid, true, 2.5, 4, 2}}) {
    SCOPED_TRACE(v.name);
    MoeConfig config = Config(v.e, v.k, DType::kF32);
    config.routed_score_func = v.func;
    config.norm_topk_prob = v.norm;
    config.routed_scaling_factor = v.scaling;
    config.n_routing_groups = v.groups;
    config.topk_routing_group = v.keep;
    ExpectFiniteDifferences(config, v.name);
  }
}

// ---- (2) Routing and group sizes on a hand-made example ----

// The expert e of x [D] in double: (silu(x wi_gate) * (x wi_up)) wo.
std::vector<double> Expert(const Inputs& in, int64_t e, const float* x) {
  const int64_t d_n = in.wi.dim(1), f_n = in.wo.dim(1);
  const float* wi = in.wi.data_as<float>() + e * d_n * 2 * f_n;
  const float* wo = in.wo.data_as<float>() + e * f_n * d_n;
  std::vector<double> y(Idx(d_n), 0.0);
  for (int64_t j = 0; j < f_n; ++j) {
    double gate = 0, up = 0;
    for (int64_t d = 0; d < d_n; ++d) {
      gate += static_cast<double>(x[d]) * wi[d * 2 * f_n + j];
      up += static_cast<double>(x[d]) * wi[d * 2 * f_n + f_n + j];
    }
    const double a = internal::SiluRef(gate) * up;
    for (int64_t d = 0; d < d_n; ++d) y[Idx(d)] += a * wo[j * d_n + d];
  }
  return y;
}

TEST(MoeReferenceTest, RoutingTiesGoToTheLowerExpert) {
  const int64_t e_n = 4, d_n = 4, k = 2, t_n = 5;
  Inputs in = RandomInputs(t_n, d_n, 3, e_n, 0.5, 7);
  // Wr = identity, so the logits are x itself.
  std::fill_n(in.router.data_as<float>(), d_n * e_n, 0.0f);
  for (int64_t d = 0; d < d_n; ++d) in.router.data_as<float>()[d * e_n + d] = 1;
  const float logits[t_n][e_n] = {
      {1, 3, 3, 0},  // experts 1, 2 (tie for first: 1 takes slot 0)
      {2, 2, 2, 2},  // experts 0, 1 (all tied)
      {0, 0, 5, 5},  // experts 2, 3
      {1, 0, 0, 0},  // experts 0, 1 (tie for second: 1 beats 2 and 3)
      {0, 0, 0, 7},  // experts 3, 0
  };
  std::copy_n(&logits[0][0], t_n * e_n, in.x.data_as<float>());
  const int64_t chosen[t_n][k] = {{1, 2}, {0, 1}, {2, 3}, {0, 1}, {3, 0}};
  const MoeConfig config = Config(e_n, k, DType::kF32);
  Result<reference::MoeReferenceResult> r =
      reference::MoeLayer(config, in.x.view(), in.weights(), nullptr);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const int32_t* gs = r->group_sizes.data_as<int32_t>();
  EXPECT_EQ(std::vector<int32_t>(gs, gs + e_n),
            (std::vector<int32_t>{3, 3, 2, 2}));
  for (int64_t t = 0; t < t_n; ++t) {
    const float* x = &logits[t][0];
    // Softmax over the two selected logits.
    const double l0 = x[chosen[t][0]], l1 = x[chosen[t][1]];
    const double w0 = 1 / (1 + std::exp(l1 - l0)), w1 = 1 - w0;
    const std::vector<double> y0 = Expert(in, chosen[t][0], x);
    const std::vector<double> y1 = Expert(in, chosen[t][1], x);
    for (int64_t d = 0; d < d_n; ++d) {
      const double want = w0 * y0[Idx(d)] + w1 * y1[Idx(d)];
      EXPECT_NEAR(r->y.data_as<float>()[t * d_n + d], want, 1e-6)
          << "token " << t << " dim " << d;
    }
  }
  // aux = 0.1 * E * sum_e f_e * mean_t softmax(x[t])[e], f = {3,3,2,2}/10.
  double aux = 0;
  for (int64_t e = 0; e < e_n; ++e) {
    double p = 0;
    for (int64_t t = 0; t < t_n; ++t) {
      double sum = 0;
      for (int64_t j = 0; j < e_n; ++j) sum += std::exp(double{logits[t][j]});
      p += std::exp(double{logits[t][e]}) / sum / t_n;
    }
    aux += gs[e] / 10.0 * p;
  }
  EXPECT_NEAR(r->aux_loss, 0.1 * e_n * aux, 1e-12);
  EXPECT_EQ(r->loss, r->aux_loss);  // no dy: the loss is the aux loss
}

TEST(MoeReferenceTest, RejectsBadShapesAndDtypes) {
  Inputs in = RandomInputs(3, 4, 2, 4, 0.5, 1);
  MoeConfig config = Config(4, 2, DType::kF32);
  ConstTensorView dy = in.dy.view();
  MoeWeights w = in.weights();
  w.wi.shape = {4, 4, 5};
  Result<reference::MoeReferenceResult> r =
      reference::MoeLayer(config, in.x.view(), w, &dy);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("wi must have shape [4, 4, 4]"),
            std::string::npos)
      << r.status().message();
  config.num_experts = 3;  // router [4, 4] has 4 experts
  r = reference::MoeLayer(config, in.x.view(), in.weights(), &dy);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("router (num_experts=3)"),
            std::string::npos)
      << r.status().message();
  config.num_experts = 4;
  dy.dtype = DType::kBF16;
  r = reference::MoeLayer(config, in.x.view(), in.weights(), &dy);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("dy must be f32"), std::string::npos)
      << r.status().message();
}

// T = 0: empty outputs, empty groups, aux 0 (a mean over no tokens is taken
// as 0), all-zero weight gradients.
TEST(MoeReferenceTest, EmptyBatch) {
  Inputs in = RandomInputs(0, 4, 3, 4, 0.5, 3);
  const MoeConfig config = Fp8Full(Config(4, 2, DType::kBF16));
  const ConstTensorView dy = in.dy.view();
  Result<reference::MoeReferenceResult> r =
      reference::MoeLayer(config, in.x.view(), in.weights(), &dy);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->y.shape(), (Shape{0, 4}));
  EXPECT_EQ(r->aux_loss, 0.0);
  EXPECT_EQ(r->loss, 0.0);
  for (int64_t e = 0; e < 4; ++e)
    EXPECT_EQ(r->group_sizes.data_as<int32_t>()[e], 0);
  EXPECT_EQ(MaxAbs(r->drouter), 0.0f);
  EXPECT_EQ(MaxAbs(r->dwi), 0.0f);
  EXPECT_EQ(MaxAbs(r->dwo), 0.0f);
}

// ---- (3) Every QAT mode against the f32 layer ----

struct QatCase {
  std::string name;
  std::function<void(MoeConfig*)> set;
  // Bounds on RelErr (max error / max |f32 value|) of y and of every gradient.
  double y_bound, grad_bound;
};

// Bounds, as max error over max |value| of the f32 layer's tensor (observed
// values on this data in brackets: y / worst gradient):
//  bf16 (8 significant bits, rel. rounding 2^-9 at each of a few rounding
//  points): 0.02 for all [0.005 / 0.007].
//  e4m3 (fake QAT, native, fp8, nanoo_fp8; 4 significant bits, rel.
//  rounding <= 2^-4 per weight and activation element; sums over D and F
//  average the independent errors): y 0.1 [0.056]. Gradients 0.2 [0.088]:
//  the router's dlogits = s_j (g_j - sum_i s_i g_i) is a difference of
//  dy . y_sorted terms, which amplifies y_sorted's relative error, and dx
//  carries that router part.
//  int8 per row / channel (step 1/127 of the amax, rel. error <= 2^-8 of it
//  per element): y 0.05 [0.018], gradients 0.1 [0.030].
//  fp8_full: the forward is the e4m3 one; the gradients pass e5m2 (3
//  significant bits, rel. rounding <= 2^-3) or e4m3 on top of the e4m3
//  codes: 0.25 [0.086].
std::vector<QatCase> QatCases() {
  using C = MoeConfig;
  return {
      {"none_bf16", [](C*) {}, 0.02, 0.02},
      {"fake_qat", [](C* c) { *c = FakeQat(*c); }, 0.1, 0.2},
      {"native_fwd", [](C* c) { *c = Native(*c); }, 0.1, 0.2},
      {"native_fwd_dlhs",
       [](C* c) {
         *c = Native(*c);
         c->fp8_moe_native_bwd_dlhs = true;
       },
       0.1, 0.2},
      {"native_fwd_block128",
       [](C* c) {
         *c = Native(*c);
         c->moe_lhs_quant_block_size = 128;
       },
       0.1, 0.2},
      {"fp8_full_e5m2", [](C* c) { *c = Fp8Full(*c); }, 0.1, 0.25},
      {"fp8_full_e4m3",
       [](C* c) {
         *c = Fp8Full(*c);
         c->bwd_quantization_dtype = QuantDType::kE4M3FN;
       },
       0.1, 0.25},
      {"fp8_full_inkernel",
       [](C* c) {
         *c = Fp8Full(*c);
         c->moe_bwd_inkernel_quant = true;
       },
       0.1, 0.25},
      {"fp8_full_inkernel_tile3",
       [](C* c) {
         *c = Fp8Full(*c);
         c->moe_bwd_inkernel_quant = true;
         c->wi_tiles.drhs.m = 3;
         c->wo_tiles.drhs.m = 3;
       },
       0.1, 0.25},
      {"int8", [](C* c) { c->quantization = MoeQuantization::kInt8; }, 0.05,
       0.1},
      {"fp8", [](C* c) { c->quantization = MoeQuantization::kFp8; }, 0.1, 0.2},
      {"nanoo_fp8", [](C* c) { c->quantization = MoeQuantization::kNanooFp8; },
       0.1, 0.2},
  };
}

class MoeReferenceQatTest : public ::testing::Test {
 protected:
  // T = 16 tokens, D = 160 (one full 128-block and a partial one of 32),
  // F = 24, E = 4, k = 2.
  MoeReferenceQatTest() : in_(RandomInputs(16, 160, 24, 4, 0.15, 11)) {}

  reference::MoeReferenceResult Run(const MoeConfig& config) {
    const ConstTensorView dy = in_.dy.view();
    Result<reference::MoeReferenceResult> r =
        reference::MoeLayer(config, in_.x.view(), in_.weights(), &dy);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *std::move(r) : reference::MoeReferenceResult{};
  }

  Inputs in_;
};

TEST_F(MoeReferenceQatTest, EveryModeIsCloseToF32) {
  const reference::MoeReferenceResult f32 = Run(Config(4, 2, DType::kF32));
  for (const QatCase& c : QatCases()) {
    SCOPED_TRACE(c.name);
    MoeConfig config = Config(4, 2, DType::kBF16);
    c.set(&config);
    ASSERT_TRUE(ValidateMoeConfig(config).ok())
        << ValidateMoeConfig(config).ToString();
    const reference::MoeReferenceResult q = Run(config);
    ASSERT_EQ(q.dwo.num_elements(), f32.dwo.num_elements());
    // The router sees f32 x and Wr in every mode: the same routing.
    EXPECT_TRUE(SameBits(q.group_sizes, f32.group_sizes));
    EXPECT_LE(RelErr(q.y, f32.y), c.y_bound);
    EXPECT_LE(RelErr(q.dx, f32.dx), c.grad_bound);
    EXPECT_LE(RelErr(q.drouter, f32.drouter), c.grad_bound);
    EXPECT_LE(RelErr(q.dwi, f32.dwi), c.grad_bound);
    EXPECT_LE(RelErr(q.dwo, f32.dwo), c.grad_bound);
    // Quantization must change something (else the mode did not run).
    if (c.name != "none_bf16") {
      EXPECT_GT(RelErr(q.y, f32.y), 1e-3);
    }
  }
}

// Modes the mode table makes numerically identical must give the same bits.
TEST_F(MoeReferenceQatTest, IdenticalModesGiveIdenticalBits) {
  const auto run = [&](const std::string& name) {
    for (const QatCase& c : QatCases()) {
      if (c.name != name) continue;
      MoeConfig config = Config(4, 2, DType::kBF16);
      c.set(&config);
      return Run(config);
    }
    ADD_FAILURE() << name;
    return reference::MoeReferenceResult{};
  };
  const auto same = [](const reference::MoeReferenceResult& a,
                       const reference::MoeReferenceResult& b) {
    return SameBits(a.y, b.y) && SameBits(a.dx, b.dx) &&
           SameBits(a.drouter, b.drouter) && SameBits(a.dwi, b.dwi) &&
           SameBits(a.dwo, b.dwo);
  };
  const reference::MoeReferenceResult native = run("native_fwd");
  // dLHS from the codes is bit-identical to dLHS from the BF16 copy.
  EXPECT_TRUE(same(native, run("native_fwd_dlhs")));
  // Hand-crafted fp8 = native forward (e4m3fn, act calibration, full rows)
  // with the same bf16 backward.
  EXPECT_TRUE(same(native, run("fp8")));
  // fp8_full's forward is the native forward.
  const reference::MoeReferenceResult full = run("fp8_full_e5m2");
  EXPECT_TRUE(SameBits(full.y, native.y));
  // In-kernel tiles of 512 rows hold a whole group here (T*k = 32 rows), so
  // they give the dense per-group scales; tiles of 3 rows do not.
  EXPECT_TRUE(same(full, run("fp8_full_inkernel")));
  const reference::MoeReferenceResult tile3 = run("fp8_full_inkernel_tile3");
  EXPECT_TRUE(SameBits(tile3.y, full.y));
  EXPECT_FALSE(SameBits(tile3.dwi, full.dwi));
  EXPECT_FALSE(SameBits(tile3.dwo, full.dwo));
  // The forward-only K-block changes the wi forward (D = 160 > 128).
  EXPECT_FALSE(SameBits(run("native_fwd_block128").y, native.y));
}

// ---- (4) The STE mask of a fixed weight calibration ----

TEST(MoeReferenceTest, FixedCalibrationMasksClippedWeights) {
  const int64_t e_n = 4, d_n = 8, f_n = 6;
  Inputs in = RandomInputs(12, d_n, f_n, e_n, 0.5, 5);
  const float clip = 0.3f;
  // One weight exactly at the clip value: inside the range, not masked.
  in.wi.data_as<float>()[3] = clip;
  in.wo.data_as<float>()[5] = -clip;
  for (const char* mode : {"fake_qat", "int8", "fp8_full"}) {
    SCOPED_TRACE(mode);
    MoeConfig config = Config(e_n, 2, DType::kBF16);
    if (std::string(mode) == "fake_qat") config = FakeQat(config);
    if (std::string(mode) == "int8")
      config.quantization = MoeQuantization::kInt8;
    if (std::string(mode) == "fp8_full") config = Fp8Full(config);
    config.weight_quantization_calibration_method =
        Calibration::Fixed(-clip, clip);
    const ConstTensorView dy = in.dy.view();
    Result<reference::MoeReferenceResult> r =
        reference::MoeLayer(config, in.x.view(), in.weights(), &dy);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const int32_t* gs = r->group_sizes.data_as<int32_t>();
    for (const auto& [w, g] :
         {std::pair{&in.wi, &r->dwi}, std::pair{&in.wo, &r->dwo}}) {
      const int64_t per_expert = w->dim(1) * w->dim(2);
      int64_t clipped = 0;
      for (size_t i = 0; i < w->num_elements(); ++i) {
        const float wv = w->data_as<float>()[i], gv = g->data_as<float>()[i];
        if (std::fabs(wv) > clip) {
          ++clipped;
          EXPECT_EQ(gv, 0.0f) << "clipped weight " << i << " = " << wv;
        } else if (gs[static_cast<int64_t>(i) / per_expert] > 0) {
          // Every unclipped weight of a routed expert gets its gradient.
          EXPECT_NE(gv, 0.0f) << "weight " << i << " = " << wv;
        }
      }
      EXPECT_GT(clipped, 0);  // U(-0.5, 0.5) puts ~40% outside 0.3
    }
  }
  // absmax never clips: no gradient is masked.
  MoeConfig config = FakeQat(Config(e_n, 2, DType::kBF16));
  const ConstTensorView dy = in.dy.view();
  Result<reference::MoeReferenceResult> r =
      reference::MoeLayer(config, in.x.view(), in.weights(), &dy);
  ASSERT_TRUE(r.ok());
  for (size_t i = 0; i < r->dwi.num_elements(); ++i) {
    if (std::fabs(in.wi.data_as<float>()[i]) > clip &&
        r->group_sizes.data_as<int32_t>()[i / (d_n * 2 * f_n)] > 0) {
      EXPECT_NE(r->dwi.data_as<float>()[i], 0.0f) << i;
    }
  }
}

}  // namespace
}  // namespace fp8moe
