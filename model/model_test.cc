// The whole model on a tiny shape: gradients of every parameter tensor
// against central finite differences of the float64 reference loss
// (reference::ModelLoss), the same bits for any thread count, no allocation
// in a steady-state step, and clear errors.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/test_seed.h"
#include "fp8moe/flag_table.h"
#include "fp8moe/memory.h"
#include "fp8moe/model.h"
#include "model/architecture_test_util.h"
#include "moe/moe_test_util.h"

namespace fp8moe {
namespace {

// E = 4 unless moe_flags sets num_experts.
ModelConfig Tiny(std::vector<std::string> moe_flags = {"dtype=float32"}) {
  ModelConfig c;
  c.vocab_size = 13;
  c.emb_dim = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.head_dim = 4;
  c.mlp_dim = 6;
  c.seq_len = 5;
  c.batch = 2;
  moe_flags.insert(moe_flags.begin(), "num_experts=4");
  moe_flags.push_back("load_balance_loss_weight=0.1");
  auto cfg = LoadConfig(MoeConfigSchema(), "", moe_flags);
  EXPECT_TRUE(cfg.ok());
  auto m = MoeConfigFrom(*cfg);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  c.moe = *m;
  return c;
}

struct Tokens {
  std::vector<int32_t> in, tgt;
  Tokens(const ModelConfig& c, uint64_t seed) {
    std::mt19937 rng(seed);
    in.resize(static_cast<size_t>(c.batch * c.seq_len));
    tgt.resize(in.size());
    for (auto& t : in) t = static_cast<int32_t>(rng() % c.vocab_size);
    for (auto& t : tgt) t = static_cast<int32_t>(rng() % c.vocab_size);
  }
};

// routed_bias: every layer's router_bias away from its initial 0 (uniform
// in [-0.1, 0.1], sigmoid scores being in (0, 1)), so the bias moves some
// choices; nothing without the flag.
void SetRouterBias(uint64_t seed, ModelParams* params) {
  std::mt19937 rng(seed + 17);
  for (auto& [name, t] : params->Named()) {
    if (!IsModelState(name)) continue;
    for (size_t i = 0; i < t->num_elements(); ++i) {
      t->data_as<float>()[i] = static_cast<float>(rng() % 2001) * 1e-4f - 0.1f;
    }
  }
}

// Checks 8 elements of every parameter tensor's gradient of one step against
// central finite differences; *near_tie is set when a tensor had fewer than 4
// elements whose perturbation kept the routing (two router logits of some
// token are within a perturbation of a tie: the loss is not differentiable
// there, and the caller draws another model).
void CheckGradients(const ModelConfig& c, uint64_t seed, bool* near_tie) {
  *near_tie = false;
  auto params = AllocateParams(c);
  ASSERT_TRUE(params.ok()) << params.status().ToString();
  ASSERT_TRUE(InitParams(c, seed, &*params).ok());
  // Norm gains away from 1, so their gradients are not a special case.
  std::mt19937 rng(seed);
  for (auto& [name, t] : params->Named()) {
    if (t->rank() != 1 || IsModelState(name)) continue;
    for (size_t i = 0; i < t->num_elements(); ++i) {
      t->data_as<float>()[i] = 0.5f + static_cast<float>(rng() % 1000) / 1000.0f;
    }
  }
  SetRouterBias(seed, &*params);
  auto grads = AllocateParams(c);
  ASSERT_TRUE(grads.ok());
  const Tokens tok(c, seed + 1);
  Context ctx;
  Model model(c);
  std::vector<PreparedMoeWeights> prepared;
  ASSERT_TRUE(model.PrepareExperts(ctx, *params, &prepared).ok());
  ModelStepInfo info;
  ASSERT_TRUE(model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info).ok());
  std::vector<int32_t> routing0;
  auto ref = reference::ModelLoss(c, *params, tok.in.data(), tok.tgt.data(), &routing0);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_NEAR(info.loss + info.aux_loss, *ref, 1e-5 * std::fabs(*ref));

  auto named_grads = grads->Named();
  auto named = params->Named();
  // Each tensor: 8 elements checked. A perturbation that flips a top-k choice
  // (the loss is not differentiable there) is retried with 10x and 100x
  // smaller steps, then another element is drawn: a fresh seed can put two
  // router logits within 1e-4 of a tie.
  int checked = 0, skipped = 0;
  for (size_t p = 0; p < named.size(); ++p) {
    if (IsModelState(named[p].first)) continue;  // router_bias: state, no gradient
    Tensor* t = named[p].second;
    const Tensor* g = named_grads[p].second;
    double scale = 0;
    for (size_t i = 0; i < g->num_elements(); ++i) {
      scale = std::max(scale, std::fabs(static_cast<double>(g->data_as<float>()[i])));
    }
    ASSERT_GT(scale, 0) << named[p].first << " has an all-zero gradient";
    int checked_here = 0;
    for (int draw = 0; draw < 32 && checked_here < 8; ++draw) {
      const size_t i = rng() % t->num_elements();
      float& v = t->data_as<float>()[i];
      const float v0 = v;
      bool done = false;
      for (float rel : {1e-3f, 1e-4f, 1e-5f}) {
        const float h = rel * std::max(1.0f, std::fabs(v0));
        std::vector<int32_t> r_up, r_down;
        v = v0 + h;
        auto up = reference::ModelLoss(c, *params, tok.in.data(), tok.tgt.data(), &r_up);
        v = v0 - h;
        auto down = reference::ModelLoss(c, *params, tok.in.data(), tok.tgt.data(), &r_down);
        const double step = static_cast<double>(v0 + h) - static_cast<double>(v0 - h);
        v = v0;
        if (r_up != routing0 || r_down != routing0) continue;  // a top-k flip
        const double fd = (*up - *down) / step;
        EXPECT_NEAR(g->data_as<float>()[i], fd, 2e-3 * scale + 1e-6)
            << named[p].first << "[" << i << "], step " << h;
        done = true;
        break;
      }
      done ? ++checked_here : ++skipped;
    }
    if (checked_here < 4) *near_tie = true;
    checked += checked_here;
  }
  if (!*near_tie) {
    EXPECT_GT(checked, 100) << skipped << " draws skipped";
  }
}

// CheckGradients on up to three models drawn from seed, until one has no
// routing tie within a perturbation (Model.GradientsMatch... says why).
void CheckGradientsOfADrawWithoutTies(const ModelConfig& c, uint64_t seed) {
  bool near_tie = true;
  for (uint64_t draw = 0; draw < 3 && near_tie; ++draw) {
    CheckGradients(c, seed + draw * 1000003, &near_tie);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_FALSE(near_tie) << "three models in a row had a routing tie within 1e-5";
}

TEST(Model, GradientsMatchFiniteDifferencesOfTheFloat64Reference) {
  FP8MOE_RANDOM_SEED(seed);
  // Softmax routing, and DeepSeek-V3's: sigmoid scores, scaled and
  // renormalised weights, 2 groups of 2 experts with 1 kept (a group flip
  // changes the experts, so the routing comparison skips it too).
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"dtype=float32"},
        std::vector<std::string>{"dtype=float32", "routed_score_func=sigmoid",
                                 "norm_topk_prob=true", "routed_scaling_factor=2.5",
                                 "n_routing_groups=2", "topk_routing_group=1"}}) {
    SCOPED_TRACE(flags.back());
    // About one seed in 5000 puts a routing tie within 1e-5 (measured).
    CheckGradientsOfADrawWithoutTies(Tiny(flags), seed);
    if (HasFatalFailure()) return;
  }
}

// The FFN variants (shared experts, dense first layers): the same check of
// every parameter, shared_wi / shared_wo and mlp_wi / mlp_wo included.
TEST(Model, SharedExpertGradientsMatchFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  for (int64_t shared : {1, 2}) {
    ModelConfig c = Tiny();
    c.shared_experts = shared;
    SCOPED_TRACE("shared_experts=" + std::to_string(shared));
    CheckGradientsOfADrawWithoutTies(c, seed);
    auto params = AllocateParams(c);
    ASSERT_TRUE(params.ok());
    int shared_tensors = 0;
    for (const auto& [name, t] : params->Named()) {
      if (name.find(".shared_w") != std::string::npos) ++shared_tensors;
    }
    EXPECT_EQ(shared_tensors, 2 * c.num_layers);
    EXPECT_EQ(params->layers[1].shared_wi.shape(), (Shape{c.emb_dim, 2 * shared * c.mlp_dim}));
    EXPECT_EQ(params->layers[1].shared_wo.shape(), (Shape{shared * c.mlp_dim, c.emb_dim}));
  }
}

TEST(Model, DenseLayerGradientsMatchFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  for (int64_t shared : {0, 1}) {
    ModelConfig c = Tiny();
    c.num_layers = 3;
    c.first_num_dense_layers = 1;
    c.base_mlp_dim = 10;
    c.shared_experts = shared;
    SCOPED_TRACE("first_num_dense_layers=1 shared_experts=" + std::to_string(shared));
    CheckGradientsOfADrawWithoutTies(c, seed);
    auto params = AllocateParams(c);
    ASSERT_TRUE(params.ok());
    std::vector<std::string> layer0;
    for (const auto& [name, t] : params->Named()) {
      if (name.starts_with("layers.0.")) layer0.push_back(name.substr(9));
    }
    EXPECT_EQ(layer0, (std::vector<std::string>{"attn_norm", "wqkv", "wo_attn", "mlp_norm",
                                                "mlp_wi", "mlp_wo"}));
    EXPECT_EQ(params->layers[0].mlp_wi.shape(), (Shape{c.emb_dim, 2 * c.base_mlp_dim}));
    EXPECT_EQ(params->layers[0].mlp_wo.shape(), (Shape{c.base_mlp_dim, c.emb_dim}));
    EXPECT_EQ(params->layers[1].shared, shared > 0);
    uint64_t total = 0;
    for (const auto& [name, t] : params->Named()) total += t->num_elements();
    EXPECT_EQ(ModelParamCount(c), total);
    // A dense layer routes nothing: its load is empty, the MoE layers' are not.
    Context ctx;
    Model model(c);
    std::vector<PreparedMoeWeights> prepared;
    ASSERT_TRUE(InitParams(c, seed, &*params).ok());
    ASSERT_TRUE(model.PrepareExperts(ctx, *params, &prepared).ok());
    const Tokens tok(c, seed);
    ModelStepInfo info;
    ASSERT_TRUE(model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), nullptr, &info).ok());
    EXPECT_TRUE(info.expert_load[0].empty());
    EXPECT_EQ(info.expert_load[1].size(), static_cast<size_t>(c.moe.num_experts));
    Fp8Health wi, wo;
    EXPECT_TRUE(model.ActivationHealth(ctx, 0, prepared, &wi, &wo).ok());
  }
}

// One step of c from InitParams(seed) into NaN-poisoned gradients: a finite
// loss and finite, non-zero gradients of every tensor (a gradient the
// backward does not write stays NaN).
void ExpectAFiniteStepWritingEveryGradient(const ModelConfig& c, uint64_t seed) {
  auto params = AllocateParams(c);
  auto grads = AllocateParams(c);
  ASSERT_TRUE(params.ok() && grads.ok());
  ASSERT_TRUE(InitParams(c, seed, &*params).ok());
  SetRouterBias(seed, &*params);
  const Tokens tok(c, seed + 1);
  Context ctx;
  Model model(c);
  std::vector<PreparedMoeWeights> prepared;
  ASSERT_TRUE(model.PrepareExperts(ctx, *params, &prepared).ok());
  // NaN-poisoned: a gradient the backward does not write stays NaN.
  for (auto& [name, t] : grads->Named()) {
    std::fill(t->data_as<float>(), t->data_as<float>() + t->num_elements(), NAN);
  }
  ModelStepInfo info;
  Status s = model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(std::isfinite(info.loss));
  for (const auto& [name, t] : grads->Named()) {
    if (IsModelState(name)) continue;  // router_bias: never written
    double sum = 0;
    for (size_t i = 0; i < t->num_elements(); ++i) sum += std::fabs(t->data_as<float>()[i]);
    EXPECT_TRUE(std::isfinite(sum) && sum > 0) << name << " " << sum;
  }
}

// Every QAT mode of the routed experts runs with a dense first layer and
// shared experts (which stay in dtype): a finite loss and finite, non-zero
// gradients of the dense MLPs' tensors.
TEST(Model, EveryRoutedQatModeRunsWithTheFfnVariants) {
  FP8MOE_RANDOM_SEED(seed);
  const std::vector<std::vector<std::string>> modes = {
      {},
      {"dtype=float32"},
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8"},
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true"},
      {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true",
       "fp8_moe_native_bwd_dlhs=true"},
      {"quantization=fp8_full", "use_qwix_quantization=true"},
      {"quantization=fp8_full", "use_qwix_quantization=true", "bwd_quantization_dtype=e4m3",
       "moe_bwd_inkernel_quant=true"},
      {"quantization=int8"},
      {"quantization=nanoo_fp8"}};
  for (const auto& flags : modes) {
    SCOPED_TRACE(flags.empty() ? "none bf16" : flags.back());
    ModelConfig c = Tiny(flags);
    c.num_layers = 3;
    c.first_num_dense_layers = 1;
    c.base_mlp_dim = 12;
    c.shared_experts = 1;
    ExpectAFiniteStepWritingEveryGradient(c, seed);
  }
}

// Loss and every gradient of one step, as bytes.
std::vector<std::vector<uint8_t>> StepBits(const ModelConfig& c, int threads, uint64_t seed) {
  auto params = AllocateParams(c);
  auto grads = AllocateParams(c);
  EXPECT_TRUE(InitParams(c, seed, &*params).ok());
  SetRouterBias(seed, &*params);
  const Tokens tok(c, seed + 1);
  ContextOptions o;
  o.threads = threads;
  Context ctx(o);
  omp_set_num_threads(threads);  // until the kernels take ctx.threads()
  Model model(c);
  std::vector<PreparedMoeWeights> prepared;
  EXPECT_TRUE(model.PrepareExperts(ctx, *params, &prepared).ok());
  ModelStepInfo info;
  EXPECT_TRUE(model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info).ok());
  std::vector<std::vector<uint8_t>> out;
  out.emplace_back(reinterpret_cast<uint8_t*>(&info.loss), reinterpret_cast<uint8_t*>(&info.loss) + 8);
  for (auto& [name, t] : grads->Named()) {
    if (IsModelState(name)) continue;  // router_bias: never written
    const auto* b = static_cast<const uint8_t*>(t->data());
    out.emplace_back(b, b + t->num_bytes());
  }
  return out;
}

// c at the wider shape of the thread-count checks (B 4, S 24, D 32, F 48): a
// finite, positive loss, and the same loss and gradient bits for 1 and 2
// threads. The caller restores OpenMP's thread count.
void ExpectTheSameBitsForOneAndTwoThreads(ModelConfig c, uint64_t seed, const std::string& what) {
  c.batch = 4;
  c.seq_len = 24;
  c.emb_dim = 32;
  c.mlp_dim = 48;
  const auto one = StepBits(c, 1, seed);
  double loss = 0;
  std::memcpy(&loss, one[0].data(), sizeof(loss));
  EXPECT_TRUE(std::isfinite(loss) && loss > 0) << what << ": loss " << loss;
  EXPECT_TRUE(one == StepBits(c, 2, seed)) << what;
}

TEST(Model, BitsDoNotDependOnTheThreadCount) {
  FP8MOE_RANDOM_SEED(seed);
  const int saved = omp_get_max_threads();
  for (auto flags : {std::vector<std::string>{"dtype=float32"}, std::vector<std::string>{},
                     std::vector<std::string>{"fp8_moe_fake_quant=true",
                                              "fp8_fake_quant_hoist=gather8",
                                              "fp8_moe_native_fwd=true",
                                              "fp8_moe_native_bwd_dlhs=true"},
                     std::vector<std::string>{"routed_score_func=sigmoid", "norm_topk_prob=true",
                                              "routed_scaling_factor=2.5", "n_routing_groups=2",
                                              "topk_routing_group=1"}}) {
    ModelConfig c = Tiny(flags);
    c.batch = 4;
    c.seq_len = 24;
    c.emb_dim = 32;
    c.mlp_dim = 48;
    EXPECT_TRUE(StepBits(c, 1, seed) == StepBits(c, 2, seed)) << (flags.empty() ? "bf16" : flags[0]);
    c.shared_experts = 2;
    EXPECT_TRUE(StepBits(c, 1, seed) == StepBits(c, 2, seed))
        << (flags.empty() ? "bf16" : flags[0]) << " with shared experts";
    c.first_num_dense_layers = 1;
    c.base_mlp_dim = 40;
    EXPECT_TRUE(StepBits(c, 1, seed) == StepBits(c, 2, seed))
        << (flags.empty() ? "bf16" : flags[0]) << " with a dense first layer";
  }
  omp_set_num_threads(saved);
}

// Steps after the first (which allocates the buffers) allocate nothing.
void ExpectSteadyStepsAllocateNothing(const ModelConfig& c) {
  auto params = AllocateParams(c);
  auto grads = AllocateParams(c);
  FP8MOE_RANDOM_SEED(seed);
  ASSERT_TRUE(InitParams(c, seed, &*params).ok());
  const Tokens tok(c, seed + 1);
  Context ctx;
  Model model(c);
  std::vector<PreparedMoeWeights> prepared;
  ModelStepInfo info;
  for (int i = 0; i < 4; ++i) {
    const int64_t before = GetMemoryStats().allocations;
    ASSERT_TRUE(model.PrepareExperts(ctx, *params, &prepared).ok());
    ASSERT_TRUE(model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info).ok());
    ASSERT_TRUE(model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), nullptr, &info).ok());
    if (i > 0) {
      EXPECT_EQ(GetMemoryStats().allocations, before) << "step " << i;
    }
  }
}

TEST(Model, SteadyStateStepAllocatesNothing) {
  ExpectSteadyStepsAllocateNothing(Tiny({"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
                                         "fp8_moe_native_fwd=true",
                                         "fp8_moe_native_bwd_dlhs=true"}));
}

// The trainer draws the initial weights a tensor at a time (never the whole
// set): the same bits as InitParams into whole tensors; ParamShapes are the
// shapes AllocateParams makes, experts included or not.
void CheckInitStreams(const ModelConfig& c) {
  auto whole = AllocateParams(c);
  ASSERT_TRUE(whole.ok());
  FP8MOE_RANDOM_SEED(seed);
  ASSERT_TRUE(InitParams(c, seed, &*whole).ok());
  const auto named = whole->Named();
  const auto shapes = ParamShapes(c);
  ASSERT_EQ(shapes.size(), named.size());
  size_t seen = 0;
  ASSERT_TRUE(InitParams(c, seed, [&](size_t k, const float* data) {
                EXPECT_EQ(k, seen++);
                ASSERT_LT(k, named.size());
                EXPECT_EQ(shapes[k].first, named[k].first);
                EXPECT_EQ(shapes[k].second, named[k].second->shape());
                EXPECT_EQ(std::memcmp(data, named[k].second->data(), named[k].second->num_bytes()), 0)
                    << named[k].first;
              }).ok());
  EXPECT_EQ(seen, named.size());
  for (int64_t rows : {int64_t{0}, int64_t{2}}) {
    auto part = AllocateParams(c, rows);
    ASSERT_TRUE(part.ok());
    const auto pn = part->Named();
    const auto ps = ParamShapes(c, rows);
    for (size_t k = 0; k < pn.size(); ++k) {
      EXPECT_EQ(pn[k].second->shape(), ps[k].second) << pn[k].first;
      const bool expert = pn[k].first.ends_with(".wi") || pn[k].first.ends_with(".wo");
      if (expert) {
        EXPECT_EQ(ps[k].second[0], rows);
      } else {
        EXPECT_EQ(ps[k].second, shapes[k].second);
      }
    }
  }
}

TEST(Model, InitParamsStreamsTheSameBitsTensorByTensor) {
  ModelConfig c = Tiny();
  CheckInitStreams(c);
  c.shared_experts = 2;
  CheckInitStreams(c);
  c.first_num_dense_layers = 1;
  c.base_mlp_dim = 5;
  CheckInitStreams(c);
  c.num_layers = 3;
  c.moe.routed_score_func = RoutedScoreFunc::kSigmoid;
  c.moe.routed_bias = true;
  CheckInitStreams(c);
}

TEST(Model, BadInputsAreClearErrors) {
  ModelConfig c = Tiny();
  c.head_dim = 3;
  Status s = ValidateModelConfig(c);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("head_dim=3"), std::string::npos) << s.message();
  c = Tiny();
  c.shared_experts = -1;
  s = ValidateModelConfig(c);
  EXPECT_NE(s.message().find("shared_experts=-1"), std::string::npos) << s.message();
  c = Tiny();
  c.first_num_dense_layers = 3;
  s = ValidateModelConfig(c);
  EXPECT_NE(s.message().find("first_num_dense_layers=3 is outside [0, base_num_decoder_layers=2]"),
            std::string::npos) << s.message();
  c = Tiny();
  c.base_mlp_dim = 0;
  EXPECT_NE(ValidateModelConfig(c).message().find("base_mlp_dim=0"), std::string::npos);
  // Every layer dense with MoE-only flags set: refused, naming them.
  c = Tiny();
  c.first_num_dense_layers = 2;
  EXPECT_TRUE(ValidateModelConfig(c).ok()) << "all dense, no MoE-only flag";
  c.shared_experts = 1;
  s = ValidateModelConfig(c);
  EXPECT_NE(s.message().find("MoE-only flags are set: shared_experts=1"), std::string::npos)
      << s.message();
  c = Tiny({"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8"});
  c.first_num_dense_layers = 2;
  s = ValidateModelConfig(c);
  EXPECT_NE(s.message().find("a QAT mode of the routed experts (fake_qat"), std::string::npos)
      << s.message();
  c = Tiny();
  auto params = AllocateParams(c);
  auto grads = AllocateParams(c);
  ASSERT_TRUE(InitParams(c, 1, &*params).ok());
  Tokens tok(c, 2);
  tok.in[3] = 99;
  Context ctx;
  Model model(c);
  std::vector<PreparedMoeWeights> prepared;
  ASSERT_TRUE(model.PrepareExperts(ctx, *params, &prepared).ok());
  ModelStepInfo info;
  s = model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("vocab"), std::string::npos) << s.message();

  // Expert tensors without experts (AllocateParams with 0) where something
  // reads or writes them: a clear error, never a read of no data.
  tok.in[3] = 1;
  ASSERT_TRUE(model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info).ok());
  auto made = AllocateParams(c, 0);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  ModelParams none = std::move(*made);
  EXPECT_EQ(none.layers[0].wi.shape(), (Shape{0, c.emb_dim, 2 * c.mlp_dim}));
  EXPECT_EQ(none.layers[1].wo.shape(), (Shape{0, c.mlp_dim, c.emb_dim}));
  EXPECT_EQ(none.embed.shape(), params->embed.shape());
  s = model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), &none, &info);
  EXPECT_NE(s.message().find("layer 0's expert weights in the gradients hold no experts"),
            std::string::npos) << s.message();
  s = model.PrepareExperts(ctx, none, &prepared);
  EXPECT_NE(s.message().find("without an ExpertWeightSource"), std::string::npos) << s.message();
  EXPECT_FALSE(AllocateParams(c, c.moe.num_experts + 1).ok());
  EXPECT_FALSE(InitParams(c, 1, &none).ok());  // needs every expert
  // Tiny()'s f32 mode reads the masters in the step itself.
  ASSERT_TRUE(MoeReadsF32Masters(c.moe));
  s = model.Step(ctx, none, prepared, tok.in.data(), tok.tgt.data(), nullptr, &info);
  EXPECT_NE(s.message().find("in the parameters hold no experts"), std::string::npos)
      << s.message();
}

// ---- Attention architectures (issue 36): grouped-query and multi-query
// attention, a head width independent of the model width ----

// Tiny() with H query heads of width hd over Hkv kv heads (H * hd != D).
ModelConfig TinyAttention(int64_t heads, int64_t kv_heads, int64_t hd,
                          std::vector<std::string> moe_flags = {"dtype=float32"}) {
  ModelConfig c = Tiny(std::move(moe_flags));
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = hd;
  return c;
}

// Every parameter's gradient, wqkv's q, k and v columns among them, against
// finite differences of the float64 twin: grouped-query (4 query heads on 2
// kv heads, hd 6: H hd = 24 over D = 8) and multi-query (3 on 1, hd 4).
TEST(Model, GroupedQueryAttentionGradientsMatchFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  for (const ModelConfig& c : {TinyAttention(4, 2, 6), TinyAttention(3, 1, 4)}) {
    SCOPED_TRACE("H " + std::to_string(c.num_heads) + " Hkv " + std::to_string(c.num_kv_heads));
    ASSERT_EQ(ParamShapes(c)[2].first, "layers.0.wqkv");
    EXPECT_EQ(ParamShapes(c)[2].second,
              (Shape{c.emb_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim}));
    CheckGradientsOfADrawWithoutTies(c, seed);
    if (HasFatalFailure()) return;
  }
}

// use_qk_norm (Qwen3): the q_norm and k_norm gains and every other
// gradient through the per-head norms against finite differences of the
// float64 twin, alone (multi-head) and with every attention knob at once
// (grouped-query, hd 6 over D 8, tied normalized logits).
TEST(Model, QkNormGradientsMatchFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  ModelConfig alone = Tiny();
  alone.use_qk_norm = true;
  ModelConfig together = TinyAttention(4, 2, 6);
  together.use_qk_norm = true;
  together.logits_via_embedding = true;
  for (const ModelConfig& c : {alone, together}) {
    SCOPED_TRACE("Hkv " + std::to_string(KvHeads(c)) + " tied " +
                 std::to_string(c.logits_via_embedding));
    const auto shapes = ParamShapes(c);
    ASSERT_EQ(shapes[4].first, "layers.0.q_norm");
    EXPECT_EQ(shapes[4].second, (Shape{c.head_dim}));
    EXPECT_EQ(shapes[5].first, "layers.0.k_norm");
    CheckGradientsOfADrawWithoutTies(c, seed);
    if (HasFatalFailure()) return;
  }
}

// base_num_kv_heads = 0 (the default) and = H are the same model: the same
// shapes, the same initial weights and the same bits as before GQA.
TEST(Model, KvHeadsEqualToTheQueryHeadsIsTheMultiHeadModel) {
  FP8MOE_RANDOM_SEED(seed);
  ModelConfig mha = Tiny();
  ASSERT_EQ(mha.num_kv_heads, 0);
  EXPECT_EQ(KvHeads(mha), mha.num_heads);
  ModelConfig same = mha;
  same.num_kv_heads = mha.num_heads;
  EXPECT_EQ(ParamShapes(mha), ParamShapes(same));
  EXPECT_EQ(ModelParamCount(mha), ModelParamCount(same));
  EXPECT_TRUE(StepBits(mha, 1, seed) == StepBits(same, 1, seed));
}

// Tied embedding and LM head (logits_via_embedding), MaxText's normalized
// logits and Hugging Face's unnormalized ones, alone and with multi-query
// attention: embed's gradient (its gather and the logits' use) and every
// other one against finite differences of the float64 twin.
TEST(Model, TiedEmbeddingGradientsMatchFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  std::vector<ModelConfig> configs;
  for (bool normalize : {true, false}) {
    ModelConfig c = Tiny();
    c.logits_via_embedding = true;
    c.normalize_embedding_logits = normalize;
    configs.push_back(c);
  }
  ModelConfig together = TinyAttention(4, 1, 6);
  together.logits_via_embedding = true;
  configs.push_back(together);
  for (const ModelConfig& c : configs) {
    SCOPED_TRACE("normalize " + std::to_string(c.normalize_embedding_logits) + " Hkv " +
                 std::to_string(KvHeads(c)));
    const auto shapes = ParamShapes(c);
    EXPECT_EQ(shapes.back().first, "final_norm");  // no lm_head
    CheckGradientsOfADrawWithoutTies(c, seed);
    if (HasFatalFailure()) return;
  }
}

// Tied: no lm_head in the parameters, the count one V x D smaller, and the
// other tensors' initial values unchanged (lm_head was drawn last).
TEST(Model, TiedEmbeddingHasNoLmHead) {
  ModelConfig untied = Tiny(), tied = Tiny();
  tied.logits_via_embedding = true;
  EXPECT_EQ(ModelParamCount(untied) - ModelParamCount(tied),
            static_cast<uint64_t>(tied.vocab_size * tied.emb_dim));
  auto a = AllocateParams(untied), b = AllocateParams(tied);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(b->has_lm_head);
  ASSERT_EQ(a->Named().size(), b->Named().size() + 1);
  ASSERT_TRUE(InitParams(untied, 7, &*a).ok());
  ASSERT_TRUE(InitParams(tied, 7, &*b).ok());
  const auto na = a->Named(), nb = b->Named();
  for (size_t k = 0; k < nb.size(); ++k) {
    EXPECT_EQ(na[k].first, nb[k].first);
    EXPECT_EQ(std::memcmp(na[k].second->data(), nb[k].second->data(), nb[k].second->num_bytes()), 0)
        << nb[k].first;
  }
  // Parameters of the other config: a clear error, not a read of no data.
  const Tokens tok(tied, 3);
  Context ctx;
  Model model(tied);
  std::vector<PreparedMoeWeights> prepared;
  ASSERT_TRUE(model.PrepareExperts(ctx, *a, &prepared).ok());
  ModelStepInfo info;
  const Status s = model.Step(ctx, *a, prepared, tok.in.data(), tok.tgt.data(), nullptr, &info);
  EXPECT_NE(s.message().find("hold an lm_head but the config has logits_via_embedding=true"),
            std::string::npos) << s.message();
}

// Every QAT mode of the routed experts runs with grouped-query and
// multi-query attention and tied logits, with the same bits for 1 and 2
// threads.
TEST(Model, GroupedQueryAttentionRunsInEveryQatModeWithTheSameBitsForAnyThreadCount) {
  FP8MOE_RANDOM_SEED(seed);
  const int saved = omp_get_max_threads();
  for (const auto& flags : test::Modes()) {
    for (auto [heads, kv] : {std::pair<int64_t, int64_t>{4, 2}, {4, 1}}) {
      ModelConfig c = TinyAttention(heads, kv, 6, flags);
      c.logits_via_embedding = kv == 1;  // MQA runs with tied logits, GQA with qk norms
      c.use_qk_norm = kv == 2;
      const std::string what = (flags.empty() ? std::string("bf16") : flags.back()) + " H " +
                               std::to_string(heads) + " Hkv " + std::to_string(kv) +
                               (c.logits_via_embedding ? " tied" : " qk_norm");
      ExpectTheSameBitsForOneAndTwoThreads(c, seed, what);
    }
  }
  omp_set_num_threads(saved);
}

// Every attention knob on: still no allocation in a steady-state step.
TEST(Model, SteadyStateStepWithEveryAttentionKnobAllocatesNothing) {
  ModelConfig c = TinyAttention(4, 2, 6, {"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
                                          "fp8_moe_native_fwd=true",
                                          "fp8_moe_native_bwd_dlhs=true"});
  c.use_qk_norm = true;
  c.logits_via_embedding = true;
  ExpectSteadyStepsAllocateNothing(c);
}

// Head counts that do not group: exit 2 in the CLI (InvalidArgument here)
// with a message naming both flags and the fix.
TEST(Model, KvHeadsThatDoNotDivideTheQueryHeadsAreAClearError) {
  ModelConfig c = TinyAttention(4, 3, 4);
  Status s = ValidateModelConfig(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("base_num_query_heads=4 is not a multiple of base_num_kv_heads=3"),
            std::string::npos) << s.message();
  EXPECT_NE(s.message().find("set base_num_kv_heads to a divisor of base_num_query_heads"),
            std::string::npos) << s.message();
  EXPECT_FALSE(AllocateParams(c).ok());
  c = TinyAttention(2, 4, 4);  // more kv heads than query heads
  EXPECT_NE(ValidateModelConfig(c).message().find("base_num_kv_heads=4"), std::string::npos);
  c = TinyAttention(4, -1, 4);
  s = ValidateModelConfig(c);
  EXPECT_NE(s.message().find("base_num_kv_heads=-1 is negative"), std::string::npos)
      << s.message();
  for (int64_t kv : {1, 2, 4}) EXPECT_TRUE(ValidateModelConfig(TinyAttention(4, kv, 4)).ok()) << kv;
}

// ---- Issue 36's architectures, every knob of each at once ----

// Tiny() with architecture a (model/architecture_test_util.h): its MoE
// flags after `mode`'s, its model flags over Tiny()'s shape.
ModelConfig TinyArchitecture(const test::Architecture& a, std::vector<std::string> mode) {
  mode.insert(mode.end(), a.moe_flags.begin(), a.moe_flags.end());
  ModelConfig c = Tiny(std::move(mode));
  auto flags = LoadConfig(ModelConfigFlags().Schema(c), "", a.model_flags);
  EXPECT_TRUE(flags.ok()) << flags.status().ToString();
  if (flags.ok()) {
    const std::vector<std::string> problems = ModelConfigFlags().Read(*flags, &c);
    EXPECT_TRUE(problems.empty()) << problems[0];
  }
  const Status valid = ValidateModelConfig(c);
  EXPECT_TRUE(valid.ok()) << a.name << ": " << valid.ToString();
  return c;
}

// Every parameter of each whole architecture (f32) against central finite
// differences of the float64 twin, perturbations that flip a top-k or group
// choice skipped (CheckGradients).
TEST(Model, EveryArchitectureGradientsMatchFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  for (const test::Architecture& a : test::Architectures()) {
    SCOPED_TRACE(a.name);
    const ModelConfig c = TinyArchitecture(a, {"dtype=float32"});
    CheckGradientsOfADrawWithoutTies(c, seed);
    if (HasFatalFailure()) return;
  }
}

// Every architecture in every QAT mode of the routed experts
// (test::EveryQatMode(), f32 first): a step at the tiny shape writes a finite
// loss and finite, non-zero gradients of every tensor, and a step at a wider
// shape has the same loss and gradient bits for 1 and 2 threads.
TEST(Model, EveryArchitectureRunsEveryQatModeWithTheSameBitsForAnyThreadCount) {
  FP8MOE_RANDOM_SEED(seed);
  const int saved = omp_get_max_threads();
  for (const test::Architecture& a : test::Architectures()) {
    for (const auto& mode : test::EveryQatMode()) {
      const std::string what = a.name + " " + (mode.empty() ? std::string("bf16") : mode.back());
      SCOPED_TRACE(what);
      const ModelConfig c = TinyArchitecture(a, mode);
      ExpectAFiniteStepWritingEveryGradient(c, seed);
      ExpectTheSameBitsForOneAndTwoThreads(c, seed, what);
    }
  }
  omp_set_num_threads(saved);
}

// ---- routed_bias (DeepSeek-V3's auxiliary-loss-free balancing) ----

// A tiny sigmoid-scored model of 3 layers, the first dense; with `bias` the
// routed_bias state.
ModelConfig TinyWithRouterBias(bool bias) {
  ModelConfig c = Tiny({"dtype=float32", "routed_score_func=sigmoid"});
  c.num_layers = 3;
  c.first_num_dense_layers = 1;
  c.base_mlp_dim = 6;
  c.moe.routed_bias = bias;
  EXPECT_TRUE(ValidateModelConfig(c).ok());
  return c;
}

// The bias exists only with the flag and only on the MoE layers, right after
// their router, shaped [E] and counted; it starts at 0 and draws nothing,
// so every other tensor starts with the bits of the model without it.
TEST(Model, RoutedBiasIsStateStartingAtZeroLeavingTheOtherInitialWeights) {
  FP8MOE_RANDOM_SEED(seed);
  const ModelConfig off = TinyWithRouterBias(false), on = TinyWithRouterBias(true);
  auto a = AllocateParams(off);
  auto b = AllocateParams(on);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(InitParams(off, seed, &*a).ok());
  ASSERT_TRUE(InitParams(on, seed, &*b).ok());
  const auto na = a->Named();
  std::vector<std::string> added;
  size_t i = 0;
  for (const auto& [name, t] : b->Named()) {
    if (IsModelState(name)) {
      added.push_back(name);
      EXPECT_EQ(t->shape(), Shape{off.moe.num_experts}) << name;
      for (size_t e = 0; e < t->num_elements(); ++e) {
        EXPECT_EQ(t->data_as<float>()[e], 0.0f) << name;
      }
      continue;
    }
    ASSERT_LT(i, na.size());
    const auto& [name0, t0] = na[i++];
    EXPECT_EQ(name0, name);
    ASSERT_EQ(t0->num_bytes(), t->num_bytes()) << name;
    EXPECT_EQ(std::memcmp(t0->data(), t->data(), t->num_bytes()), 0) << name;
  }
  EXPECT_EQ(i, na.size());
  EXPECT_EQ(added, (std::vector<std::string>{"layers.1.router_bias", "layers.2.router_bias"}));
  const auto names = ParamShapes(on);
  for (size_t k = 0; k + 1 < names.size(); ++k) {
    if (IsModelState(names[k + 1].first)) {
      EXPECT_TRUE(names[k].first.ends_with(".router"));
    }
  }
  EXPECT_EQ(ModelParamCount(on), ModelParamCount(off) + 2 * static_cast<uint64_t>(on.moe.num_experts));
  // A routed_bias model refuses parameters without the bias (it would route
  // without it, silently).
  Context ctx;
  Model model(on);
  std::vector<PreparedMoeWeights> prepared;
  ASSERT_TRUE(model.PrepareExperts(ctx, *a, &prepared).ok());
  const Tokens tok(on, seed);
  ModelStepInfo info;
  const Status s = model.Step(ctx, *a, prepared, tok.in.data(), tok.tgt.data(), nullptr, &info);
  EXPECT_NE(s.message().find("layer 1 of the parameters has no router_bias"), std::string::npos)
      << s.ToString();
}

// The bias moves the choice and never the weights: a bias that is the same
// for every expert changes no bit of the loss; one that lifts expert 0 above
// every score routes every token of every MoE layer to it (the sigmoid
// scores are in (0, 1)); and with a random bias the model matches its float64
// twin.
TEST(Model, RoutedBiasMovesTheChoiceNotTheWeightsAndMatchesTheTwin) {
  FP8MOE_RANDOM_SEED(seed);
  const ModelConfig c = TinyWithRouterBias(true);
  const int64_t E = c.moe.num_experts, T = c.batch * c.seq_len;
  auto params = AllocateParams(c);
  ASSERT_TRUE(params.ok());
  ASSERT_TRUE(InitParams(c, seed, &*params).ok());
  const Tokens tok(c, seed + 1);
  auto step = [&](ModelStepInfo* info) {
    Context ctx;
    Model model(c);
    std::vector<PreparedMoeWeights> prepared;
    ASSERT_TRUE(model.PrepareExperts(ctx, *params, &prepared).ok());
    Status s = model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), nullptr, info);
    ASSERT_TRUE(s.ok()) << s.ToString();
  };
  auto set_bias = [&](const std::function<float(int64_t)>& value) {
    for (auto& [name, t] : params->Named()) {
      if (!IsModelState(name)) continue;
      for (int64_t e = 0; e < E; ++e) t->data_as<float>()[e] = value(e);
    }
  };
  ModelStepInfo zero, flat, lifted, drawn;
  step(&zero);
  set_bias([](int64_t) { return 0.25f; });
  step(&flat);
  EXPECT_EQ(zero.loss, flat.loss);
  EXPECT_EQ(zero.expert_load, flat.expert_load);
  set_bias([](int64_t e) { return e == 0 ? 1.0f : 0.0f; });
  step(&lifted);
  for (int64_t l = 1; l < c.num_layers; ++l) {
    EXPECT_EQ(lifted.expert_load[static_cast<size_t>(l)][0], T) << "layer " << l;
  }
  EXPECT_NE(lifted.loss, zero.loss);
  SetRouterBias(seed, &*params);
  step(&drawn);
  auto ref = reference::ModelLoss(c, *params, tok.in.data(), tok.tgt.data());
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  EXPECT_NEAR(drawn.loss + drawn.aux_loss, *ref, 1e-5 * std::fabs(*ref));
  // The twin reads the bias too: with it lifted the twin's loss is the
  // lifted model's.
  set_bias([](int64_t e) { return e == 0 ? 1.0f : 0.0f; });
  auto lifted_ref = reference::ModelLoss(c, *params, tok.in.data(), tok.tgt.data());
  ASSERT_TRUE(lifted_ref.ok());
  EXPECT_NEAR(lifted.loss + lifted.aux_loss, *lifted_ref, 1e-5 * std::fabs(*lifted_ref));
}

// Every other parameter's gradient against finite differences of the twin
// with a nonzero bias (it has no gradient: it is state).
TEST(Model, RoutedBiasGradientsMatchFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  CheckGradientsOfADrawWithoutTies(TinyWithRouterBias(true), seed);
}

// MaxText's rule (layers/moe.py calculate_load_balance_updates):
// bias += rate x sign(sum / E - load), the sign of 0 being 0.
TEST(Model, UpdateRoutedBiasFollowsMaxTextsRule) {
  std::vector<float> bias = {0.5f, -0.25f, 0.0f, 1.0f};
  const std::vector<int32_t> load = {3, 5, 4, 4};  // mean 4: two experts at it
  UpdateRoutedBias(load.data(), 4, 0.125, bias.data());
  EXPECT_EQ(bias, (std::vector<float>{0.625f, -0.375f, 0.0f, 1.0f}));
  // A mean between integers: nobody sits on it.
  std::vector<float> two = {0.0f, 0.0f, 0.0f};
  const std::vector<int32_t> odd = {1, 2, 0};  // mean 1
  UpdateRoutedBias(odd.data(), 3, 0.5, two.data());
  EXPECT_EQ(two, (std::vector<float>{0.0f, -0.5f, 0.5f}));
  const std::vector<int32_t> halves = {1, 2};  // mean 1.5
  std::vector<float> h = {0.0f, 0.0f};
  UpdateRoutedBias(halves.data(), 2, 1e-3, h.data());
  EXPECT_EQ(h, (std::vector<float>{1e-3f, -1e-3f}));
  // No tokens (every load 0 = the mean), or a rate of 0: nothing moves.
  const std::vector<int32_t> none = {0, 0};
  UpdateRoutedBias(none.data(), 2, 1.0, h.data());
  UpdateRoutedBias(halves.data(), 2, 0.0, h.data());
  EXPECT_EQ(h, (std::vector<float>{1e-3f, -1e-3f}));
  // Loads whose E x load_e passes 2^31 are compared exactly.
  const std::vector<int32_t> big = {2147483647, 2147483646, 2147483647, 2147483646};
  std::vector<float> b4(4, 0.0f);
  UpdateRoutedBias(big.data(), 4, 1.0, b4.data());
  EXPECT_EQ(b4, (std::vector<float>{-1.0f, 1.0f, -1.0f, 1.0f}));
}

// ---- Multi-head latent attention (attention_type=mla) ----

// Tiny() with MLA: H 2, nope 6, r 4 (qk 10), vd 3, kvl 5, q_lora_rank ql.
// nope != r, so a k_nope / k_rope column offset mixed up shows.
ModelConfig TinyMla(int64_t ql, bool interleave) {
  ModelConfig c = Tiny();
  c.attention_type = "mla";
  c.q_lora_rank = ql;
  c.kv_lora_rank = 5;
  c.qk_nope_head_dim = 6;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 3;
  c.rope_interleave = interleave;
  EXPECT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c).ToString();
  return c;
}

// Every MLA tensor (and every other) against finite differences of the
// float64 twin, whose loss the f32 step matches within 1e-5 (CheckGradients):
// a plain and a compressed q projection, interleaved and half RoPE pairs,
// value heads narrower (3) and wider (11) than qk (10), an odd head (nope 3,
// r 2: qk 5) and one head (H 1).
TEST(Model, MlaGradientsMatchFiniteDifferences) {
  FP8MOE_RANDOM_SEED(seed);
  struct Case {
    int64_t ql;
    bool interleave;
    int64_t nope, r, vd, heads;
  };
  for (const Case& k : {Case{0, true, 6, 4, 3, 2}, Case{0, false, 6, 4, 11, 2},
                        Case{6, true, 6, 4, 3, 2}, Case{6, false, 3, 2, 3, 2},
                        Case{0, true, 3, 2, 4, 1}}) {
    SCOPED_TRACE("q_lora_rank " + std::to_string(k.ql) + " rope_interleave " +
                 std::to_string(k.interleave) + " nope " + std::to_string(k.nope) + " rope " +
                 std::to_string(k.r) + " v_head_dim " + std::to_string(k.vd) + " heads " +
                 std::to_string(k.heads));
    ModelConfig c = TinyMla(k.ql, k.interleave);
    c.qk_nope_head_dim = k.nope;
    c.qk_rope_head_dim = k.r;
    c.v_head_dim = k.vd;
    c.num_heads = k.heads;
    ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c).ToString();
    std::vector<std::string> names;
    for (const auto& [name, shape] : ParamShapes(c)) {
      if (name.rfind("layers.0.", 0) == 0) names.push_back(name.substr(9));
    }
    const std::vector<std::string> want =
        k.ql == 0 ? std::vector<std::string>{"attn_norm", "wq", "wkv_a", "kv_a_norm", "wkv_b",
                                             "wo_attn", "mlp_norm", "router", "wi", "wo"}
                  : std::vector<std::string>{"attn_norm", "wq_a", "q_a_norm", "wq_b", "wkv_a",
                                             "kv_a_norm", "wkv_b", "wo_attn", "mlp_norm",
                                             "router", "wi", "wo"};
    EXPECT_EQ(names, want);
    CheckGradientsOfADrawWithoutTies(c, seed);
    if (HasFatalFailure()) return;
  }
}

// An odd head (qk_nope_head_dim 3, qk_rope_head_dim 2: qk 5) is a valid
// config that trains: plain gradient descent on one batch lowers the loss
// with finite steps throughout (the rope op once refused any odd head).
TEST(Model, MlaWithAnOddHeadTrains) {
  FP8MOE_RANDOM_SEED(seed);
  ModelConfig c = TinyMla(0, true);
  c.qk_nope_head_dim = 3;
  c.qk_rope_head_dim = 2;
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c).ToString();
  auto params = AllocateParams(c);
  auto grads = AllocateParams(c);
  ASSERT_TRUE(params.ok() && grads.ok());
  ASSERT_TRUE(InitParams(c, seed, &*params).ok());
  const Tokens tok(c, seed + 1);
  Context ctx;
  Model model(c);
  std::vector<double> losses;
  for (int step = 0; step < 20; ++step) {
    std::vector<PreparedMoeWeights> prepared;
    ASSERT_TRUE(model.PrepareExperts(ctx, *params, &prepared).ok());
    ModelStepInfo info;
    const Status s =
        model.Step(ctx, *params, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(std::isfinite(info.loss)) << "step " << step;
    losses.push_back(info.loss);
    auto named = params->Named();
    auto named_grads = grads->Named();
    for (size_t p = 0; p < named.size(); ++p) {
      if (IsModelState(named[p].first)) continue;
      float* w = named[p].second->data_as<float>();
      const float* g = named_grads[p].second->data_as<float>();
      for (size_t i = 0; i < named[p].second->num_elements(); ++i) w[i] -= 0.5f * g[i];
    }
  }
  EXPECT_LT(losses.back(), 0.9 * losses.front())
      << "first " << losses.front() << ", last " << losses.back();
}

// The Hugging Face layouts (transposed): wq_b [ql, H qk], wkv_a [D, kvl + r],
// wkv_b [kvl, H (nope + vd)], wo_attn [H vd, D]; the count matches the shapes.
TEST(Model, MlaShapesAreTheHuggingFaceTensorsTransposed) {
  const ModelConfig c = TinyMla(6, true);
  std::map<std::string, Shape> shapes;
  uint64_t total = 0;
  for (const auto& [name, shape] : ParamShapes(c)) {
    shapes[name] = shape;
    total += NumElements(shape);
  }
  EXPECT_EQ(shapes["layers.1.wq_a"], (Shape{8, 6}));
  EXPECT_EQ(shapes["layers.1.q_a_norm"], (Shape{6}));
  EXPECT_EQ(shapes["layers.1.wq_b"], (Shape{6, 2 * 10}));
  EXPECT_EQ(shapes["layers.1.wkv_a"], (Shape{8, 5 + 4}));
  EXPECT_EQ(shapes["layers.1.kv_a_norm"], (Shape{5}));
  EXPECT_EQ(shapes["layers.1.wkv_b"], (Shape{5, 2 * (6 + 3)}));
  EXPECT_EQ(shapes["layers.1.wo_attn"], (Shape{2 * 3, 8}));
  EXPECT_EQ(shapes.count("layers.0.wqkv"), 0u);
  EXPECT_EQ(ModelParamCount(c), total);
  uint64_t plain = 0;
  for (const auto& [name, shape] : ParamShapes(TinyMla(0, true))) plain += NumElements(shape);
  EXPECT_EQ(ModelParamCount(TinyMla(0, true)), plain);
}

// rope_interleave changes the model (the pairs differ), and a step in every
// routed QAT mode is finite with the same bits for 1 and 2 threads under mla
// with a plain q projection (the architectures' row covers the compressed one).
TEST(Model, MlaRopeInterleaveMattersAndRunsEveryQatMode) {
  FP8MOE_RANDOM_SEED(seed);
  EXPECT_FALSE(StepBits(TinyMla(0, true), 1, seed) == StepBits(TinyMla(0, false), 1, seed));
  const int saved = omp_get_max_threads();
  for (const auto& mode : test::EveryQatMode()) {
    const std::string what = "mla " + (mode.empty() ? std::string("bf16") : mode.back());
    SCOPED_TRACE(what);
    ModelConfig c = Tiny(mode);
    const ModelConfig m = TinyMla(0, false);
    c.attention_type = m.attention_type;
    c.q_lora_rank = 0;
    c.kv_lora_rank = m.kv_lora_rank;
    c.qk_nope_head_dim = m.qk_nope_head_dim;
    c.qk_rope_head_dim = m.qk_rope_head_dim;
    c.v_head_dim = m.v_head_dim;
    c.rope_interleave = false;
    ExpectAFiniteStepWritingEveryGradient(c, seed);
    ExpectTheSameBitsForOneAndTwoThreads(c, seed, what);
  }
  omp_set_num_threads(saved);
}

// A steady-state MLA step (compressed q) allocates nothing.
TEST(Model, SteadyStateMlaStepAllocatesNothing) {
  ExpectSteadyStepsAllocateNothing(TinyMla(6, true));
}

// A step of c given parameters, then gradients, of the other attention
// layout `other` is an InvalidArgument naming attention_type=`type`'s
// tensors (not a read out of bounds or a matmul's generic shape error);
// c's own step runs.
void ExpectAStepRefusesTheOtherLayout(const ModelConfig& c, const ModelConfig& other,
                                      const std::string& type) {
  auto right = AllocateParams(c);
  auto wrong = AllocateParams(other);
  auto grads = AllocateParams(c);
  auto wrong_grads = AllocateParams(other);
  ASSERT_TRUE(right.ok() && wrong.ok() && grads.ok() && wrong_grads.ok());
  ASSERT_TRUE(InitParams(c, 1, &*right).ok());
  ASSERT_TRUE(InitParams(other, 1, &*wrong).ok());
  const Tokens tok(c, 2);
  Context ctx;
  Model model(c);
  std::vector<PreparedMoeWeights> prepared;
  ASSERT_TRUE(model.PrepareExperts(ctx, *right, &prepared).ok());
  ModelStepInfo info;
  const Status s =
      model.Step(ctx, *wrong, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("the parameters do not hold attention_type=" + type + "'s tensors"),
            std::string::npos)
      << s.message();
  const Status g =
      model.Step(ctx, *right, prepared, tok.in.data(), tok.tgt.data(), &*wrong_grads, &info);
  EXPECT_EQ(g.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(g.message().find("the gradients do not hold attention_type=" + type + "'s tensors"),
            std::string::npos)
      << g.message();
  EXPECT_TRUE(
      model.Step(ctx, *right, prepared, tok.in.data(), tok.tgt.data(), &*grads, &info).ok());
}

// Parameters or gradients of the global attention layout given to an mla
// model.
TEST(Model, MlaStepRefusesParametersOfAnotherLayout) {
  ExpectAStepRefusesTheOtherLayout(TinyMla(6, true), Tiny(), "mla");
}

// The mirror: MLA-layout parameters (no wqkv) or gradients given to a
// global-attention model; the message lists the global layout's tensors.
TEST(Model, GlobalStepRefusesParametersOfTheMlaLayout) {
  ExpectAStepRefusesTheOtherLayout(Tiny(), TinyMla(6, true), "global");
  ExpectAStepRefusesTheOtherLayout(Tiny(), TinyMla(0, false), "global");
}

// The MLA flags that make no sense are refused, each naming its flags and
// the fix.
TEST(Model, MlaBadFlagsAreClearErrors) {
  struct Bad {
    std::function<void(ModelConfig&)> set;
    const char* says;
  };
  const std::vector<Bad> bad = {
      {[](ModelConfig& c) { c.kv_lora_rank = 0; }, "kv_lora_rank=0 must be in [1, 2^31)"},
      {[](ModelConfig& c) { c.qk_nope_head_dim = 0; }, "qk_nope_head_dim=0 must be"},
      {[](ModelConfig& c) { c.qk_rope_head_dim = -2; }, "qk_rope_head_dim=-2 must be"},
      {[](ModelConfig& c) { c.v_head_dim = 0; }, "v_head_dim=0 must be"},
      {[](ModelConfig& c) { c.qk_rope_head_dim = 3; }, "qk_rope_head_dim=3 is odd"},
      {[](ModelConfig& c) { c.q_lora_rank = -1; }, "q_lora_rank=-1 must be in [0, 2^31)"},
      {[](ModelConfig& c) { c.num_kv_heads = 1; }, "base_num_kv_heads=1 with attention_type=mla"},
      {[](ModelConfig& c) { c.use_qk_norm = true; }, "use_qk_norm=true with attention_type=mla"},
      {[](ModelConfig& c) { c.rope_type = "yarn"; }, "YaRN RoPE scaling is not implemented yet"},
      {[](ModelConfig& c) { c.rope_type = "llama3.1"; }, "rope_type=llama3.1 is not implemented"},
      {[](ModelConfig& c) { c.attention_type = "local_sliding"; },
       "attention_type=local_sliding is not implemented; set attention_type=global or "
       "attention_type=mla"},
  };
  for (const Bad& b : bad) {
    ModelConfig c = TinyMla(0, true);
    b.set(c);
    const Status s = ValidateModelConfig(c);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << b.says;
    EXPECT_NE(s.message().find(b.says), std::string::npos) << s.message();
  }
  // Without mla the MLA sizes are unread (as in MaxText): no error, but a
  // negative one (MaxText types them as non-negative ints).
  ModelConfig global = Tiny();
  global.kv_lora_rank = 0;
  global.qk_rope_head_dim = 3;
  EXPECT_TRUE(ValidateModelConfig(global).ok());
  global.v_head_dim = -1;
  EXPECT_NE(ValidateModelConfig(global).message().find("v_head_dim=-1 is negative"),
            std::string::npos);
}

}  // namespace
}  // namespace fp8moe
