#include "fp8moe/moe_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/quant.h"

#ifndef FP8MOE_SOURCE_DIR
#error "FP8MOE_SOURCE_DIR must name the source tree (see moe/CMakeLists.txt)"
#endif

namespace fp8moe {
namespace {

using Overrides = std::vector<std::string>;

// Passes if `text` contains `part`; on failure prints both.
::testing::AssertionResult Contains(const char* text_expr,
                                    const char* part_expr,
                                    const std::string& text,
                                    const std::string& part) {
  if (text.find(part) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << text_expr << " does not contain " << part_expr
         << "\n  text: " << text << "\n  part: " << part;
}
#define EXPECT_CONTAINS(text, part) EXPECT_PRED_FORMAT2(Contains, text, part)

// The flags as a user sets them: schema defaults, then `overrides`, then
// conversion and validation.
Result<MoeConfig> Load(const Overrides& overrides) {
  FP8MOE_ASSIGN_OR_RETURN(Config c,
                          LoadConfig(MoeConfigSchema(), "", overrides));
  return MoeConfigFrom(c);
}

// The error message of loading `overrides`; fails the test if they load.
std::string Problem(const Overrides& overrides) {
  Result<MoeConfig> r = Load(overrides);
  if (r.ok()) {
    std::string joined;
    for (const std::string& o : overrides) joined += o + " ";
    ADD_FAILURE() << "expected an error for: " << joined;
    return "";
  }
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  return r.status().message();
}

// The config of `overrides`; fails the test (and returns defaults) on error.
MoeConfig Valid(const Overrides& overrides) {
  Result<MoeConfig> r = Load(overrides);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : MoeConfig{};
}

Overrides Plus(Overrides a, const Overrides& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The smallest valid native-forward setup.
const Overrides kNative = {"fp8_moe_fake_quant=true",
                           "fp8_fake_quant_hoist=gather8",
                           "fp8_moe_native_fwd=true"};
const Overrides kFp8Full = {"quantization=fp8_full",
                            "use_qwix_quantization=true"};

const std::vector<std::string> kTileNames = {
    "wi_tile_fwd_batch_seq",  "wi_tile_fwd_embed_dim",  "wi_tile_fwd_mlp_dim",
    "wi_tile_dlhs_batch_seq", "wi_tile_dlhs_embed_dim", "wi_tile_dlhs_mlp_dim",
    "wi_tile_drhs_batch_seq", "wi_tile_drhs_embed_dim", "wi_tile_drhs_mlp_dim",
    "wo_tile_fwd_batch_seq",  "wo_tile_fwd_embed_dim",  "wo_tile_fwd_mlp_dim",
    "wo_tile_dlhs_batch_seq", "wo_tile_dlhs_embed_dim", "wo_tile_dlhs_mlp_dim",
    "wo_tile_drhs_batch_seq", "wo_tile_drhs_embed_dim", "wo_tile_drhs_mlp_dim",
};

// The tile flags that are a GMM's k (the kernels need them even).
const std::set<std::string> kKTiles = {
    "wi_tile_fwd_embed_dim", "wi_tile_dlhs_mlp_dim",   "wi_tile_drhs_embed_dim",
    "wo_tile_fwd_mlp_dim",   "wo_tile_dlhs_embed_dim", "wo_tile_drhs_mlp_dim",
};

// ---- Schema and defaults ----

TEST(MoeConfigSchemaTest, HasEveryFlagWithDocAndChoices) {
  const ConfigSchema schema = MoeConfigSchema();
  std::vector<std::string> expected = {
      "dtype",
      "num_experts",
      "num_experts_per_tok",
      "sparse_matmul",
      "capacity_factor",
      "ragged_buffer_factor",
      "norm_topk_prob",
      "quantization",
      "use_qwix_quantization",
      "fp8_moe_fake_quant",
      "fp8_fake_quant_hoist",
      "fp8_moe_native_fwd",
      "fp8_moe_native_bwd_dlhs",
      "moe_bwd_inkernel_quant",
      "bwd_quantization_dtype",
      "weight_quantization_calibration_method",
      "act_quantization_calibration_method",
      "bwd_quantization_calibration_method",
      "remat_policy",
      "load_balance_loss_weight",
      "ici_tensor_parallelism",
      "moe_lhs_quant_block_size",
      "moe_quantize_token_all_gather",
      "num_moe_token_chunks",
      "routed_score_func",
      "routed_scaling_factor",
      "n_routing_groups",
      "topk_routing_group",
      "routed_bias",
      "routed_bias_update_rate",
  };
  expected.insert(expected.end(), kTileNames.begin(), kTileNames.end());
  EXPECT_EQ(schema.flags().size(), expected.size());
  for (const std::string& name : expected) {
    const FlagSpec* spec = schema.Find(name);
    ASSERT_NE(spec, nullptr) << name;
    EXPECT_FALSE(spec->doc.empty()) << name;
    EXPECT_EQ(spec->doc.find('\n'), std::string::npos) << name;
  }
  for (const std::string& name : kTileNames) {
    EXPECT_EQ(schema.Find(name)->type, FlagType::kInt) << name;
    EXPECT_EQ(schema.Find(name)->default_value, "-1") << name;
  }
  EXPECT_EQ(schema.Find("dtype")->choices,
            (std::vector<std::string>{"bfloat16", "float32"}));
  EXPECT_EQ(
      schema.Find("quantization")->choices,
      (std::vector<std::string>{"", "int8", "fp8", "nanoo_fp8", "fp8_full"}));
  EXPECT_EQ(schema.Find("fp8_fake_quant_hoist")->choices,
            (std::vector<std::string>{"", "gather8"}));
  EXPECT_EQ(schema.Find("bwd_quantization_dtype")->choices,
            (std::vector<std::string>{"e5m2", "e4m3"}));
  EXPECT_EQ(schema.Find("remat_policy")->choices,
            (std::vector<std::string>{"full", "moe_x_sorted"}));
}

TEST(MoeConfigSchemaTest, DefaultsConvertToDefaultMoeConfig) {
  Result<MoeConfig> r = MoeConfigFrom(Config(MoeConfigSchema()));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const MoeConfig& m = *r;
  EXPECT_EQ(m.dtype, DType::kBF16);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.num_experts_per_tok, 2);
  EXPECT_TRUE(m.sparse_matmul);
  EXPECT_EQ(m.capacity_factor, -1.0);
  EXPECT_EQ(m.ragged_buffer_factor, -1.0);
  EXPECT_FALSE(m.norm_topk_prob);
  EXPECT_EQ(m.quantization, MoeQuantization::kNone);
  EXPECT_FALSE(m.use_qwix_quantization);
  EXPECT_FALSE(m.fp8_moe_fake_quant);
  EXPECT_EQ(m.fp8_fake_quant_hoist, Fp8FakeQuantHoist::kNone);
  EXPECT_FALSE(m.fp8_moe_native_fwd);
  EXPECT_FALSE(m.fp8_moe_native_bwd_dlhs);
  EXPECT_FALSE(m.moe_bwd_inkernel_quant);
  EXPECT_EQ(m.bwd_quantization_dtype, QuantDType::kE5M2);
  EXPECT_EQ(m.weight_quantization_calibration_method.kind,
            Calibration::Kind::kAbsMax);
  EXPECT_EQ(m.act_quantization_calibration_method.kind,
            Calibration::Kind::kAbsMax);
  EXPECT_EQ(m.bwd_quantization_calibration_method.kind,
            Calibration::Kind::kAbsMax);
  EXPECT_EQ(m.remat_policy, MoeRematPolicy::kFull);
  EXPECT_DOUBLE_EQ(m.load_balance_loss_weight, 0.01);
  EXPECT_EQ(m.ici_tensor_parallelism, 1);
  EXPECT_EQ(m.moe_lhs_quant_block_size, 0);
  for (const MoeGmmTiles* w : {&m.wi_tiles, &m.wo_tiles}) {
    for (const GmmTiles* t : {&w->fwd, &w->dlhs, &w->drhs}) {
      EXPECT_FALSE(t->m.has_value());
      EXPECT_FALSE(t->k.has_value());
      EXPECT_FALSE(t->n.has_value());
    }
  }
  // The struct's own defaults are the schema's.
  const MoeConfig d;
  EXPECT_EQ(d.dtype, m.dtype);
  EXPECT_EQ(d.num_experts, m.num_experts);
  EXPECT_EQ(d.num_experts_per_tok, m.num_experts_per_tok);
  EXPECT_EQ(d.capacity_factor, m.capacity_factor);
  EXPECT_EQ(d.ragged_buffer_factor, m.ragged_buffer_factor);
  EXPECT_EQ(d.load_balance_loss_weight, m.load_balance_loss_weight);
  EXPECT_EQ(d.bwd_quantization_dtype, m.bwd_quantization_dtype);
  EXPECT_TRUE(ValidateMoeConfig(d).ok());
  EXPECT_EQ(PlanMoeQuantization(m), MoeQuantPlan{});
}

TEST(MoeConfigSchemaTest, FlagsComposeIntoALargerSchema) {
  ConfigSchema trainer;
  ASSERT_TRUE(trainer.Add({"learning_rate", FlagType::kFloat, "3e-4"}).ok());
  ASSERT_TRUE(AddMoeConfigFlags(&trainer).ok());
  Result<Config> c =
      LoadConfig(trainer, "", {"num_experts=4", "learning_rate=1e-3"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Result<MoeConfig> m = MoeConfigFrom(*c);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->num_experts, 4);

  ConfigSchema clash;
  ASSERT_TRUE(clash.Add({"num_experts", FlagType::kInt, "8"}).ok());
  EXPECT_CONTAINS(AddMoeConfigFlags(&clash).message(), "num_experts");
}

TEST(MoeConfigSchemaTest, Names) {
  EXPECT_EQ(MoeQuantizationName(MoeQuantization::kNone), "");
  EXPECT_EQ(MoeQuantizationName(MoeQuantization::kNanooFp8), "nanoo_fp8");
  EXPECT_EQ(MoeQuantizationName(MoeQuantization::kFp8Full), "fp8_full");
  EXPECT_EQ(MoeQatModeName(MoeQatMode::kFakeQat), "fake_qat");
  EXPECT_EQ(MoeQatModeName(MoeQatMode::kNativeFwdDlhs), "native_fwd_dlhs");
  EXPECT_EQ(MoeQatModeName(MoeQatMode::kRecipeFp8Full), "fp8_full");
}

TEST(MoeConfigSchemaTest, ConvertsEveryTypedField) {
  const MoeConfig m =
      Valid({"dtype=float32", "num_experts=16", "num_experts_per_tok=4",
             "norm_topk_prob=true", "ragged_buffer_factor=2.0",
             "load_balance_loss_weight=0", "remat_policy=moe_x_sorted",
             "weight_quantization_calibration_method="
             "fixed,-224,224",
             "act_quantization_calibration_method=fixed,-1,2"});
  EXPECT_EQ(m.dtype, DType::kF32);
  EXPECT_EQ(m.num_experts, 16);
  EXPECT_EQ(m.num_experts_per_tok, 4);
  EXPECT_TRUE(m.norm_topk_prob);
  EXPECT_EQ(m.ragged_buffer_factor, 2.0);
  EXPECT_EQ(m.load_balance_loss_weight, 0.0);
  EXPECT_EQ(m.remat_policy, MoeRematPolicy::kMoeXSorted);
  EXPECT_EQ(m.weight_quantization_calibration_method.kind,
            Calibration::Kind::kFixed);
  EXPECT_EQ(m.weight_quantization_calibration_method.lo, -224.0f);
  EXPECT_EQ(m.weight_quantization_calibration_method.hi, 224.0f);
  EXPECT_EQ(m.act_quantization_calibration_method.FixedAmax(), 2.0f);
}

// ---- docs/design.md §4.2 rules (docs/config.md), one test each: the
// invalid case names the flag and the fix; the fixed case loads. ----

TEST(MoeConfigRulesTest, NativeFwdRequiresFakeQuant) {
  const std::string e =
      Problem({"fp8_fake_quant_hoist=gather8", "fp8_moe_native_fwd=true"});
  EXPECT_CONTAINS(e, "fp8_moe_native_fwd=true requires fp8_moe_fake_quant");
  EXPECT_CONTAINS(e, "set fp8_moe_fake_quant=true");
  Valid(kNative);
}

TEST(MoeConfigRulesTest, NativeFwdRequiresGather8) {
  const std::string e =
      Problem({"fp8_moe_fake_quant=true", "fp8_moe_native_fwd=true"});
  EXPECT_CONTAINS(e,
                  "fp8_moe_native_fwd=true requires "
                  "fp8_fake_quant_hoist=gather8");
  EXPECT_CONTAINS(e, "set fp8_fake_quant_hoist=gather8");
}

TEST(MoeConfigRulesTest, NativeFwdRequiresSparseMatmul) {
  const std::string e = Problem(Plus(kNative, {"sparse_matmul=false"}));
  EXPECT_CONTAINS(e, "fp8_moe_native_fwd=true requires sparse_matmul=true");
  EXPECT_CONTAINS(e, "set sparse_matmul=true");
}

TEST(MoeConfigRulesTest, NativeFwdRequiresUnsplitK) {
  const std::string e = Problem(Plus(kNative, {"ici_tensor_parallelism=2"}));
  EXPECT_CONTAINS(e,
                  "fp8_moe_native_fwd=true requires an unsplit "
                  "contraction dim");
  EXPECT_CONTAINS(e, "ici_tensor_parallelism=2");
  EXPECT_CONTAINS(e, "set ici_tensor_parallelism=1");
  Valid(Plus(kNative, {"ici_tensor_parallelism=1"}));
}

TEST(MoeConfigRulesTest, TensorParallelismIsNotImplemented) {
  std::string e = Problem({"ici_tensor_parallelism=4"});
  EXPECT_CONTAINS(e, "ici_tensor_parallelism=4");
  EXPECT_CONTAINS(e, "no tensor parallelism");
  EXPECT_CONTAINS(e, "set ici_tensor_parallelism=1");
  e = Problem({"ici_tensor_parallelism=0"});
  EXPECT_CONTAINS(e, "ici_tensor_parallelism=0 must be at least 1");
}

TEST(MoeConfigRulesTest, NativeDlhsRequiresNativeFwd) {
  const std::string e =
      Problem({"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8",
               "fp8_moe_native_bwd_dlhs=true"});
  EXPECT_CONTAINS(e,
                  "fp8_moe_native_bwd_dlhs=true requires "
                  "fp8_moe_native_fwd=true");
  EXPECT_CONTAINS(e, "set fp8_moe_native_fwd=true");
  EXPECT_CONTAINS(e, "drop fp8_moe_native_bwd_dlhs");
  Valid(Plus(kNative, {"fp8_moe_native_bwd_dlhs=true"}));
}

TEST(MoeConfigRulesTest, InkernelQuantRequiresFp8Full) {
  const std::string e =
      Problem({"use_qwix_quantization=true", "moe_bwd_inkernel_quant=true"});
  EXPECT_CONTAINS(e, "moe_bwd_inkernel_quant=true");
  EXPECT_CONTAINS(e, "quantization=''");
  EXPECT_CONTAINS(e, "set quantization=fp8_full");
}

TEST(MoeConfigRulesTest, InkernelQuantRequiresRecipeMode) {
  const std::string e =
      Problem({"quantization=fp8_full", "moe_bwd_inkernel_quant=true"});
  EXPECT_CONTAINS(e, "moe_bwd_inkernel_quant=true requires recipe mode");
  EXPECT_CONTAINS(e, "set use_qwix_quantization=true");
  Valid(Plus(kFp8Full, {"moe_bwd_inkernel_quant=true"}));
}

TEST(MoeConfigRulesTest, FakeQuantAndSchemeBothClaimTheGmms) {
  for (const char* scheme : {"int8", "fp8", "nanoo_fp8"}) {
    const std::string q = std::string("quantization=") + scheme;
    const std::string e = Problem({"fp8_moe_fake_quant=true", q});
    EXPECT_CONTAINS(e, "fp8_moe_fake_quant=true and " + q);
    EXPECT_CONTAINS(e, "both claim the expert GMMs");
    EXPECT_CONTAINS(e, "set quantization=''");
    EXPECT_CONTAINS(e, "or drop fp8_moe_fake_quant to keep the scheme");
  }
  // The native flags built on fake QAT are named too.
  std::string e = Problem(
      Plus(kNative, {"fp8_moe_native_bwd_dlhs=true", "quantization=fp8"}));
  EXPECT_CONTAINS(e,
                  "fp8_moe_fake_quant=true, fp8_moe_native_fwd=true, "
                  "fp8_moe_native_bwd_dlhs=true and quantization=fp8 both "
                  "claim");
  EXPECT_CONTAINS(e,
                  "drop fp8_moe_fake_quant, fp8_moe_native_fwd, "
                  "fp8_moe_native_bwd_dlhs to keep the scheme");
  e = Problem(Plus(kFp8Full, {"fp8_moe_fake_quant=true"}));
  EXPECT_CONTAINS(e, "quantization=fp8_full both claim");
  Valid({"fp8_moe_fake_quant=true", "quantization="});
}

TEST(MoeConfigRulesTest, FakeQuantIsNotRunInRecipeMode) {
  const std::string e =
      Problem({"fp8_moe_fake_quant=true", "use_qwix_quantization=true"});
  EXPECT_CONTAINS(e, "fp8_moe_fake_quant=true with use_qwix_quantization=true");
  EXPECT_CONTAINS(e,
                  "set use_qwix_quantization=false or drop "
                  "fp8_moe_fake_quant");
  Valid({"fp8_moe_fake_quant=true", "use_qwix_quantization=false"});
}

TEST(MoeConfigRulesTest, HoistWithoutFakeQuantHasNothingToHoist) {
  const std::string e = Problem({"fp8_fake_quant_hoist=gather8"});
  EXPECT_CONTAINS(e,
                  "fp8_fake_quant_hoist=gather8 without "
                  "fp8_moe_fake_quant=true has nothing to hoist");
  EXPECT_CONTAINS(e,
                  "set fp8_moe_fake_quant=true or drop "
                  "fp8_fake_quant_hoist");
  Valid({"fp8_fake_quant_hoist=gather8", "fp8_moe_fake_quant=true"});
}

TEST(MoeConfigRulesTest, Fp8FullIsARecipe) {
  const std::string e = Problem({"quantization=fp8_full"});
  EXPECT_CONTAINS(e, "quantization=fp8_full is a recipe");
  EXPECT_CONTAINS(e, "set use_qwix_quantization=true");
  Valid(kFp8Full);
}

TEST(MoeConfigRulesTest, LhsQuantBlockSizeValues) {
  for (const char* bad : {"64", "-128", "256", "1"}) {
    const std::string e = Problem(
        Plus(kNative, {std::string("moe_lhs_quant_block_size=") + bad}));
    EXPECT_CONTAINS(e, std::string("moe_lhs_quant_block_size=") + bad +
                           " is not supported");
    EXPECT_CONTAINS(e, "set moe_lhs_quant_block_size=0");
  }
  for (const char* good : {"0", "128", "512"}) {
    EXPECT_EQ(
        Valid(Plus(kNative, {std::string("moe_lhs_quant_block_size=") + good}))
            .moe_lhs_quant_block_size,
        std::stoi(good));
  }
}

TEST(MoeConfigRulesTest, LhsQuantBlockSizeNeedsNativeFwd) {
  const std::string e = Problem({"moe_lhs_quant_block_size=128"});
  EXPECT_CONTAINS(e,
                  "moe_lhs_quant_block_size=128 only applies to the native "
                  "forward");
  EXPECT_CONTAINS(e,
                  "set fp8_moe_native_fwd=true or drop "
                  "moe_lhs_quant_block_size");
  // Fake QAT alone does not quantize the activation either.
  Problem({"fp8_moe_fake_quant=true", "moe_lhs_quant_block_size=512"});
}

TEST(MoeConfigRulesTest, ExpertCounts) {
  std::string e = Problem({"num_experts=0", "num_experts_per_tok=1"});
  EXPECT_CONTAINS(e, "num_experts=0 must be at least 1");
  EXPECT_CONTAINS(e, "set num_experts to a positive count");
  e = Problem({"num_experts_per_tok=0"});
  EXPECT_CONTAINS(e, "num_experts_per_tok=0 must be at least 1");
  EXPECT_CONTAINS(e, "set num_experts_per_tok=1");
  e = Problem({"num_experts_per_tok=9"});
  EXPECT_CONTAINS(e, "num_experts_per_tok=9 exceeds num_experts=8");
  EXPECT_CONTAINS(e, "set num_experts_per_tok=8 or lower");
  Valid({"num_experts_per_tok=8"});
  Valid({"num_experts=1", "num_experts_per_tok=1"});
}

TEST(MoeConfigRulesTest, TilesArePositiveOrMinusOne) {
  for (const std::string& name : kTileNames) {
    for (const char* bad : {"0", "-2", "-512"}) {
      const std::string e = Problem({name + "=" + bad});
      EXPECT_CONTAINS(e, name + "=" + bad + " is not a tile size");
      EXPECT_CONTAINS(e, "set " + name +
                             "=-1 (chosen per shape) or a positive "
                             "size");
    }
    Valid({name + "=-1"});
    Valid({name + "=256"});
  }
}

TEST(MoeConfigRulesTest, KTilesMustBeEven) {
  for (const std::string& name : kTileNames) {
    if (kKTiles.count(name)) {
      const std::string e = Problem({name + "=127"});
      EXPECT_CONTAINS(e, name + "=127 is odd");
      EXPECT_CONTAINS(e, "set " + name + "=128 (even) or -1");
    } else {
      Valid({name + "=127"});  // m and n tiles may be odd
    }
  }
}

TEST(MoeConfigRulesTest, DenseMatmulIsNotImplemented) {
  const std::string e = Problem({"sparse_matmul=false"});
  EXPECT_CONTAINS(e, "sparse_matmul=false");
  EXPECT_CONTAINS(e, "dense (capacity-based) MoE path");
  EXPECT_CONTAINS(e, "not implement");
  EXPECT_CONTAINS(e, "set sparse_matmul=true");
}

TEST(MoeConfigRulesTest, CapacityFactorPointsToRaggedBufferFactor) {
  for (const char* v : {"1.25", "0", "-2"}) {
    const std::string e = Problem({std::string("capacity_factor=") + v});
    EXPECT_CONTAINS(e, std::string("capacity_factor=") + v + " has no effect");
    EXPECT_CONTAINS(e, std::string("set ragged_buffer_factor=") + v +
                           " instead and drop capacity_factor");
  }
  Valid({"capacity_factor=-1"});
  Valid({"capacity_factor=-1.0", "ragged_buffer_factor=1.25"});
}

TEST(MoeConfigRulesTest, CalibrationsMustParse) {
  for (const char* name : {"weight_quantization_calibration_method",
                           "act_quantization_calibration_method",
                           "bwd_quantization_calibration_method"}) {
    for (const char* bad : {"absmin", "fixed,1", "fixed,0,0", ""}) {
      const std::string e =
          Problem(Plus(kFp8Full, {std::string(name) + "=" + bad}));
      EXPECT_CONTAINS(e, std::string(name) + "='" + bad + "'");
      EXPECT_CONTAINS(e, std::string("set ") + name + "=absmax");
    }
    Valid(Plus(kFp8Full, {std::string(name) + "=fixed,-224,224"}));
    Valid({std::string(name) + "=absmax"});
  }
}

TEST(MoeConfigRulesTest, BwdSettingsAreReadOnlyByFp8Full) {
  std::string e = Problem({"bwd_quantization_dtype=e4m3"});
  EXPECT_CONTAINS(e,
                  "bwd_quantization_dtype=e4m3 is read only by the fp8_full "
                  "recipe");
  EXPECT_CONTAINS(e, "drop bwd_quantization_dtype");
  e = Problem({"quantization=fp8",
               "bwd_quantization_calibration_method="
               "fixed,-1,1"});
  EXPECT_CONTAINS(e,
                  "bwd_quantization_calibration_method=fixed,-1,1 is read "
                  "only by the fp8_full recipe, but quantization=fp8");
  Valid(Plus(kFp8Full, {"bwd_quantization_dtype=e4m3"}));
}

TEST(MoeConfigRulesTest, BwdDtypeChoices) {
  Result<Config> c =
      LoadConfig(MoeConfigSchema(), "", {"bwd_quantization_dtype=e4m4"});
  ASSERT_FALSE(c.ok());
  EXPECT_CONTAINS(c.status().message(), "bwd_quantization_dtype");
  EXPECT_CONTAINS(c.status().message(), "'e5m2', 'e4m3'");
  EXPECT_CONTAINS(c.status().message(), "did you mean 'e4m3'?");
  EXPECT_EQ(Valid(Plus(kFp8Full, {"bwd_quantization_dtype=e4m3"}))
                .bwd_quantization_dtype,
            QuantDType::kE4M3FN);
  EXPECT_EQ(Valid(Plus(kFp8Full, {"bwd_quantization_dtype=e5m2"}))
                .bwd_quantization_dtype,
            QuantDType::kE5M2);
}

TEST(MoeConfigRulesTest, NegativeLoadBalanceWeight) {
  const std::string e = Problem({"load_balance_loss_weight=-0.5"});
  EXPECT_CONTAINS(e, "load_balance_loss_weight=-0.5 is negative");
  EXPECT_CONTAINS(e, "set load_balance_loss_weight=0");
}

TEST(MoeConfigRulesTest, RoutingFunctions) {
  // The accepted ones first: MaxText's defaults, DeepSeek-V3's routing.
  EXPECT_TRUE(Load({}).ok());
  EXPECT_TRUE(Load({"routed_score_func=softmax", "routed_scaling_factor=2.5"}).ok());
  EXPECT_TRUE(Load({"routed_score_func=sigmoid", "norm_topk_prob=true", "num_experts=8",
                    "num_experts_per_tok=4", "n_routing_groups=4", "topk_routing_group=2"})
                  .ok());
  EXPECT_CONTAINS(Problem({"routed_score_func=tanh"}), "routed_score_func");
  for (const char* bad : {"routed_scaling_factor=0", "routed_scaling_factor=-1"}) {
    const std::string e = Problem({bad});
    EXPECT_CONTAINS(e, "must be a finite positive number");
    EXPECT_CONTAINS(e, "set routed_scaling_factor=1");
  }
  MoeConfig inf;
  inf.routed_scaling_factor = std::numeric_limits<double>::infinity();
  EXPECT_CONTAINS(ValidateMoeConfig(inf).message(), "routed_scaling_factor=inf");
  const std::string softmax = Problem({"num_experts=8", "n_routing_groups=4",
                                       "topk_routing_group=2"});
  EXPECT_CONTAINS(softmax, "n_routing_groups=4 ranks groups by their sigmoid scores");
  EXPECT_CONTAINS(softmax, "set routed_score_func=sigmoid");
  const std::string divide = Problem({"routed_score_func=sigmoid", "num_experts=8",
                                      "n_routing_groups=3", "topk_routing_group=1"});
  EXPECT_CONTAINS(divide, "n_routing_groups=3 must divide num_experts=8");
  EXPECT_CONTAINS(Problem({"routed_score_func=sigmoid", "num_experts=8", "n_routing_groups=8",
                           "topk_routing_group=1"}),
                  "groups of at least 2 experts");
  const std::string few = Problem({"routed_score_func=sigmoid", "num_experts=8",
                                   "num_experts_per_tok=5", "n_routing_groups=4",
                                   "topk_routing_group=2"});
  EXPECT_CONTAINS(few, "topk_routing_group=2 x 2 experts per group");
  EXPECT_CONTAINS(few, "less than num_experts_per_tok=5");
  EXPECT_CONTAINS(Problem({"routed_score_func=sigmoid", "num_experts=8", "n_routing_groups=4",
                           "topk_routing_group=5"}),
                  "topk_routing_group=5 is outside [1, 4]");
  EXPECT_CONTAINS(Problem({"routed_score_func=sigmoid", "num_experts=8", "n_routing_groups=4"}),
                  "topk_routing_group=-1 is outside [1, 4]");
  EXPECT_CONTAINS(Problem({"topk_routing_group=2"}),
                  "topk_routing_group=2 without n_routing_groups");
}

TEST(MoeConfigRulesTest, RoutedBias) {
  // MaxText's defaults: both off.
  const MoeConfig defaults;
  EXPECT_FALSE(defaults.routed_bias);
  EXPECT_EQ(defaults.routed_bias_update_rate, 0.0);
  EXPECT_TRUE(Load({"routed_bias=false", "routed_bias_update_rate=0"}).ok());
  // A rate without the bias names both flags and the fix.
  const std::string rate = Problem({"routed_bias_update_rate=0.001"});
  EXPECT_CONTAINS(rate, "routed_bias_update_rate=0.001 is set but routed_bias=false");
  EXPECT_CONTAINS(rate, "set routed_bias=true or drop routed_bias_update_rate");
  EXPECT_CONTAINS(Problem({"routed_bias_update_rate=-0.001"}),
                  "routed_bias_update_rate=-0.001 must be a finite number >= 0");
  for (const double bad : {std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()}) {
    MoeConfig c;
    c.routed_bias_update_rate = bad;
    EXPECT_CONTAINS(ValidateMoeConfig(c).message(), "must be a finite number >= 0") << bad;
  }
  // The bias moves in f32: a rate that rounds to 0 or past f32's range is
  // refused (it would never move the bias, or make it inf).
  for (const char* bad : {"routed_bias_update_rate=1e-50", "routed_bias_update_rate=1e39"}) {
    EXPECT_CONTAINS(Problem({"routed_score_func=sigmoid", "routed_bias=true", bad}),
                    "is outside float32's range") << bad;
  }
  EXPECT_TRUE(Load({"routed_score_func=sigmoid", "routed_bias=true",
                    "routed_bias_update_rate=1e-40"}).ok());  // an f32 subnormal still moves it
  // The bias is of sigmoid scores (the route op refuses it with softmax).
  const std::string softmax = Problem({"routed_bias=true"});
  EXPECT_CONTAINS(softmax, "routed_bias=true biases the sigmoid scores");
  EXPECT_CONTAINS(softmax, "set routed_score_func=sigmoid or routed_bias=false");
  // With sigmoid scores the pair is accepted, with or without a rate.
  EXPECT_TRUE(Load({"routed_score_func=sigmoid", "routed_bias=true",
                    "routed_bias_update_rate=0.001"}).ok());
  EXPECT_TRUE(Load({"routed_score_func=sigmoid", "routed_bias=true"}).ok());
}

TEST(MoeConfigRulesTest, EveryProblemIsReportedAtOnce) {
  const std::string e = Problem({"sparse_matmul=false", "num_experts_per_tok=9",
                                 "wo_tile_fwd_mlp_dim=0"});
  EXPECT_CONTAINS(e, "(3 problems)");
  EXPECT_CONTAINS(e, "sparse_matmul=false");
  EXPECT_CONTAINS(e, "num_experts_per_tok=9");
  EXPECT_CONTAINS(e, "wo_tile_fwd_mlp_dim=0");
}

TEST(MoeConfigRulesTest, ValidateCatchesProgrammaticConfigs) {
  MoeConfig m;
  m.wi_tiles.drhs.k = 0;
  EXPECT_CONTAINS(ValidateMoeConfig(m).message(), "wi_tile_drhs_embed_dim=0");
  m = MoeConfig{};
  m.dtype = DType::kF16;
  EXPECT_CONTAINS(ValidateMoeConfig(m).message(), "set dtype=bfloat16");
  m = MoeConfig{};
  m.quantization = MoeQuantization::kFp8Full;
  m.use_qwix_quantization = true;
  m.bwd_quantization_calibration_method = Calibration::Fixed(0.0f, 0.0f);
  EXPECT_CONTAINS(ValidateMoeConfig(m).message(),
                  "bwd_quantization_calibration_method=");
}

// ---- The config system's own checks, on MoE keys ----

TEST(MoeConfigRulesTest, MisspelledKeySuggestsTheFlag) {
  Result<Config> c =
      LoadConfig(MoeConfigSchema(), "", {"fp8_moe_native_fw=true"});
  ASSERT_FALSE(c.ok());
  EXPECT_CONTAINS(c.status().message(), "unknown key 'fp8_moe_native_fw'");
  EXPECT_CONTAINS(c.status().message(), "did you mean 'fp8_moe_native_fwd'?");
  c = LoadConfig(MoeConfigSchema(), "", {"nmu_experts=4"});
  ASSERT_FALSE(c.ok());
  EXPECT_CONTAINS(c.status().message(), "did you mean 'num_experts'?");
}

TEST(MoeConfigRulesTest, ValuesAreTypeChecked) {
  Result<Config> c = LoadConfig(MoeConfigSchema(), "", {"num_experts=eight"});
  ASSERT_FALSE(c.ok());
  EXPECT_CONTAINS(c.status().message(),
                  "invalid value 'eight' for integer key 'num_experts'");
  c = LoadConfig(MoeConfigSchema(), "", {"fp8_moe_fake_quant=yes"});
  ASSERT_FALSE(c.ok());
  EXPECT_CONTAINS(c.status().message(), "'fp8_moe_fake_quant'");
  c = LoadConfig(MoeConfigSchema(), "", {"quantization=fp9"});
  ASSERT_FALSE(c.ok());
  EXPECT_CONTAINS(c.status().message(), "did you mean 'fp8'?");
}

// ---- Scheme -> GMM dtypes (docs/design.md §4.1) ----

// The forward GMM dtypes of `overrides` after validation.
GmmQuantDtypes FwdDtypes(const Overrides& overrides) {
  return PlanMoeQuantization(Valid(overrides)).fwd;
}

TEST(MoeQuantPlanTest, Seed003SixCases) {
  const GmmQuantDtypes none{};
  // use_qwix_quantization=false: every scheme quantizes the GMM.
  EXPECT_EQ(FwdDtypes({"quantization=fp8"}),
            (GmmQuantDtypes{QuantDType::kE4M3FN, QuantDType::kE4M3FN}));
  EXPECT_EQ(FwdDtypes({"quantization=nanoo_fp8"}),
            (GmmQuantDtypes{QuantDType::kE4M3FNUZ, QuantDType::kE4M3FNUZ}));
  EXPECT_EQ(FwdDtypes({"quantization=int8"}),
            (GmmQuantDtypes{QuantDType::kInt8, QuantDType::kInt8}));
  EXPECT_EQ(FwdDtypes({"quantization="}), none);
  // use_qwix_quantization=true with a scheme other than fp8_full: none.
  EXPECT_EQ(FwdDtypes({"quantization=fp8", "use_qwix_quantization=true"}),
            none);
  EXPECT_EQ(FwdDtypes({"quantization=int8", "use_qwix_quantization=true"}),
            none);
}

TEST(MoeQuantPlanTest, SchemeModes) {
  for (const char* q : {"int8", "fp8", "nanoo_fp8"}) {
    const std::string flag = std::string("quantization=") + q;
    MoeQuantPlan p = PlanMoeQuantization(Valid({flag}));
    EXPECT_EQ(p.mode, MoeQatMode::kHandCrafted) << q;
    EXPECT_FALSE(p.bwd_dtype.has_value()) << q;
    EXPECT_FALSE(p.inkernel_bwd) << q;
    p = PlanMoeQuantization(Valid({flag, "use_qwix_quantization=true"}));
    EXPECT_EQ(p, MoeQuantPlan{}) << q;
  }
  EXPECT_EQ(PlanMoeQuantization(Valid({"use_qwix_quantization=true"})),
            MoeQuantPlan{});
  EXPECT_EQ(PlanMoeQuantization(Valid({})), MoeQuantPlan{});
  EXPECT_EQ(PlanMoeQuantization(Valid({"dtype=float32"})).mode,
            MoeQatMode::kNone);
}

TEST(MoeQuantPlanTest, FakeAndNativeQat) {
  MoeQuantPlan fake = PlanMoeQuantization(
      Valid({"fp8_moe_fake_quant=true", "fp8_fake_quant_hoist=gather8"}));
  EXPECT_EQ(fake.mode, MoeQatMode::kFakeQat);
  EXPECT_EQ(fake.fwd, (GmmQuantDtypes{std::nullopt, QuantDType::kE4M3FN}));
  EXPECT_FALSE(fake.bwd_dtype.has_value());
  EXPECT_FALSE(fake.inkernel_bwd);
  // Hoisting changes where the codes come from, not what the GMM gets.
  EXPECT_EQ(PlanMoeQuantization(Valid({"fp8_moe_fake_quant=true"})), fake);

  const MoeQuantPlan native = PlanMoeQuantization(Valid(kNative));
  EXPECT_EQ(native.mode, MoeQatMode::kNativeFwd);
  EXPECT_EQ(native.fwd,
            (GmmQuantDtypes{QuantDType::kE4M3FN, QuantDType::kE4M3FN}));
  EXPECT_FALSE(native.bwd_dtype.has_value());

  const MoeQuantPlan dlhs = PlanMoeQuantization(
      Valid(Plus(kNative, {"fp8_moe_native_bwd_dlhs=true"})));
  EXPECT_EQ(dlhs.mode, MoeQatMode::kNativeFwdDlhs);
  EXPECT_EQ(dlhs.fwd, native.fwd);
  EXPECT_FALSE(dlhs.bwd_dtype.has_value());
}

TEST(MoeQuantPlanTest, Fp8FullRecipe) {
  MoeQuantPlan p = PlanMoeQuantization(Valid(kFp8Full));
  EXPECT_EQ(p.mode, MoeQatMode::kRecipeFp8Full);
  EXPECT_EQ(p.fwd, (GmmQuantDtypes{QuantDType::kE4M3FN, QuantDType::kE4M3FN}));
  EXPECT_EQ(p.bwd_dtype, QuantDType::kE5M2);
  EXPECT_FALSE(p.inkernel_bwd);
  p = PlanMoeQuantization(
      Valid(Plus(kFp8Full, {"bwd_quantization_dtype=e4m3",
                            "moe_bwd_inkernel_quant=true"})));
  EXPECT_EQ(p.mode, MoeQatMode::kRecipeFp8Full);
  EXPECT_EQ(p.bwd_dtype, QuantDType::kE4M3FN);
  EXPECT_TRUE(p.inkernel_bwd);
}

// ---- Tile mapping ----

TEST(MoeConfigTilesTest, FlagsMapToGmmTiles) {
  // A distinct even value per flag: 2, 4, ..., 36 in kTileNames order.
  Overrides o;
  for (size_t i = 0; i < kTileNames.size(); ++i) {
    o.push_back(kTileNames[i] + "=" + std::to_string(2 * (i + 1)));
  }
  const MoeConfig m = Valid(o);
  // wi [E, D, 2F].
  EXPECT_EQ(m.wi_tiles.fwd.m, 2);    // wi_tile_fwd_batch_seq
  EXPECT_EQ(m.wi_tiles.fwd.k, 4);    // wi_tile_fwd_embed_dim
  EXPECT_EQ(m.wi_tiles.fwd.n, 6);    // wi_tile_fwd_mlp_dim
  EXPECT_EQ(m.wi_tiles.dlhs.m, 8);   // wi_tile_dlhs_batch_seq
  EXPECT_EQ(m.wi_tiles.dlhs.n, 10);  // wi_tile_dlhs_embed_dim: output cols
  EXPECT_EQ(m.wi_tiles.dlhs.k, 12);  // wi_tile_dlhs_mlp_dim: reduction
  EXPECT_EQ(m.wi_tiles.drhs.m, 14);  // wi_tile_drhs_batch_seq: reduction
  EXPECT_EQ(m.wi_tiles.drhs.k, 16);  // wi_tile_drhs_embed_dim: output rows
  EXPECT_EQ(m.wi_tiles.drhs.n, 18);  // wi_tile_drhs_mlp_dim
  // wo [E, F, D]: embed_dim and mlp_dim swap roles.
  EXPECT_EQ(m.wo_tiles.fwd.m, 20);   // wo_tile_fwd_batch_seq
  EXPECT_EQ(m.wo_tiles.fwd.n, 22);   // wo_tile_fwd_embed_dim
  EXPECT_EQ(m.wo_tiles.fwd.k, 24);   // wo_tile_fwd_mlp_dim
  EXPECT_EQ(m.wo_tiles.dlhs.m, 26);  // wo_tile_dlhs_batch_seq
  EXPECT_EQ(m.wo_tiles.dlhs.k, 28);  // wo_tile_dlhs_embed_dim
  EXPECT_EQ(m.wo_tiles.dlhs.n, 30);  // wo_tile_dlhs_mlp_dim
  EXPECT_EQ(m.wo_tiles.drhs.m, 32);  // wo_tile_drhs_batch_seq
  EXPECT_EQ(m.wo_tiles.drhs.n, 34);  // wo_tile_drhs_embed_dim
  EXPECT_EQ(m.wo_tiles.drhs.k, 36);  // wo_tile_drhs_mlp_dim

  // One flag set, the rest stay per shape.
  const MoeConfig one = Valid({"wo_tile_dlhs_embed_dim=256"});
  EXPECT_EQ(one.wo_tiles.dlhs.k, 256);
  EXPECT_FALSE(one.wo_tiles.dlhs.m.has_value());
  EXPECT_FALSE(one.wo_tiles.dlhs.n.has_value());
  EXPECT_FALSE(one.wi_tiles.dlhs.k.has_value());
}

// ---- configs/base.yml ----

// configs/base.yml is the trainer's whole schema written out (train_test
// checks it equals TrainConfigSchema()); here: it holds every MoE flag once,
// with a comment above it and a value the MoE schema accepts, and those
// values make a valid MoE configuration.
TEST(MoeConfigBaseYamlTest, HoldsEveryMoeFlagWithACommentAndAValidValue) {
  const std::string path = std::string(FP8MOE_SOURCE_DIR) + "/configs/base.yml";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const ConfigSchema schema = MoeConfigSchema();
  Config moe(schema);
  std::map<std::string, int> seen;
  std::string line, previous;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != '#' && line[0] != ' ') {
      const size_t colon = line.find(':');
      const std::string key = line.substr(0, colon);
      if (schema.Find(key) != nullptr) {
        ++seen[key];
        EXPECT_EQ(previous.rfind("# ", 0), 0u) << key << " has no comment line above it";
        std::string value = line.substr(colon + 1);
        while (!value.empty() && value[0] == ' ') value.erase(0, 1);
        if (value == "\"\"") value.clear();
        const Status s = moe.Set(key, value, path);
        EXPECT_TRUE(s.ok()) << s.ToString();
      }
    }
    previous = line;
  }
  for (const FlagSpec& spec : schema.flags()) {
    EXPECT_EQ(seen[spec.name], 1) << spec.name << " must appear once in " << path;
  }
  Result<MoeConfig> m = MoeConfigFrom(moe);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
}

}  // namespace
}  // namespace fp8moe
