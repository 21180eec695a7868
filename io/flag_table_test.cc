// Flag tables (include/fp8moe/flag_table.h) on a small struct shaped like the
// trainer's: the schema comes from the rows with the struct's defaults, every
// flag reads into its field and writes back to text that reads back to the
// same value, ranges name the flag, unknown keys suggest the closest name,
// nested tables bind the inner struct, and a row added to a table is in its
// schema and its documented YAML.
#include "fp8moe/flag_table.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fp8moe {
namespace {

enum class Color : uint8_t { kRed, kGreen, kBlue };

struct Inner {
  int64_t depth = 3;
  std::optional<int64_t> tile;
};

struct Sample {
  int64_t count = 8;
  uint64_t seed = 0;
  double rate = 0.5;
  bool on = true;
  std::string name = "run";
  std::string mode = "fast";
  Color color = Color::kGreen;
  Inner inner;
};

FlagTable<Inner> InnerFlags() {
  FlagTable<Inner> t;
  t.Int("inner_depth", &Inner::depth, "Depth of the inner part.", {.min = 1, .show_value = true});
  t.OptionalInt("inner_tile", &Inner::tile, "A tile; -1 = chosen per shape.");
  return t;
}

FlagTable<Sample> SampleFlags() {
  FlagTable<Sample> t;
  t.Section("Counts");
  t.Int("count", &Sample::count, "How many.", {.min = 1, .max = 100, .show_value = true});
  t.Int("seed", &Sample::seed, "A seed.", {.min = 0});
  t.Float("rate", &Sample::rate, "A rate in (0, 1).",
          {.min = 0, .max = 1, .min_open = true, .max_open = true, .show_value = true,
           .note = ": a share"});
  t.Section("Switches\nand names");
  t.Bool("on", &Sample::on, "Whether it runs.").ResumeNeutral();
  t.String("name", &Sample::name, "The name.");
  t.String("mode", &Sample::mode, "The mode.", {"fast", "slow"});
  t.Enum("color", &Sample::color, "The color.",
         {{"red", Color::kRed}, {"green", Color::kGreen}, {"blue", Color::kBlue}});
  t.Section("Inner");
  t.Nest(&Sample::inner, InnerFlags());
  return t;
}

TEST(FlagTable, TheSchemaHasEveryRowWithTheStructsDefaults) {
  const FlagTable<Sample> flags = SampleFlags();
  const ConfigSchema schema = flags.Schema();
  const std::vector<std::pair<std::string, std::string>> want = {
      {"count", "8"},  {"seed", "0"},  {"rate", "0.5"},        {"on", "true"},
      {"name", "run"}, {"mode", "fast"}, {"color", "green"}, {"inner_depth", "3"},
      {"inner_tile", "-1"}};
  ASSERT_EQ(schema.flags().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(schema.flags()[i].name, want[i].first);
    EXPECT_EQ(schema.flags()[i].default_value, want[i].second) << want[i].first;
    EXPECT_FALSE(schema.flags()[i].doc.empty());
  }
  EXPECT_EQ(schema.Find("count")->type, FlagType::kInt);
  EXPECT_EQ(schema.Find("rate")->type, FlagType::kFloat);
  EXPECT_EQ(schema.Find("on")->type, FlagType::kBool);
  EXPECT_EQ(schema.Find("color")->type, FlagType::kString);
  EXPECT_EQ(schema.Find("color")->choices, (std::vector<std::string>{"red", "green", "blue"}));
  EXPECT_EQ(schema.Find("mode")->choices, (std::vector<std::string>{"fast", "slow"}));
  // Defaults from another struct value (a larger struct's own defaults).
  Sample other;
  other.count = 42;
  other.inner.tile = 64;
  const ConfigSchema from_other = flags.Schema(other);
  EXPECT_EQ(from_other.Find("count")->default_value, "42");
  EXPECT_EQ(from_other.Find("inner_tile")->default_value, "64");
  // Sections: on the row that follows them, nested ones included.
  const FlagTable<Sample> table = SampleFlags();
  const auto& rows = table.rows();
  EXPECT_EQ(rows[0].section, "Counts");
  EXPECT_EQ(rows[3].section, "Switches\nand names");
  EXPECT_EQ(rows[7].section, "Inner");
  EXPECT_EQ(rows[1].section, "");
  EXPECT_TRUE(rows[3].resume_neutral);
  EXPECT_FALSE(rows[0].resume_neutral);
}

TEST(FlagTable, EveryFlagReadsIntoItsFieldAndWritesBack) {
  const FlagTable<Sample> t = SampleFlags();
  auto c = LoadConfig(t.Schema(), "",
                      {"count=12", "seed=7", "rate=0.125", "on=false", "name=a b", "mode=slow",
                       "color=blue", "inner_depth=5", "inner_tile=256"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Sample s;
  EXPECT_TRUE(t.Read(*c, &s).empty());
  EXPECT_EQ(s.count, 12);
  EXPECT_EQ(s.seed, 7u);
  EXPECT_EQ(s.rate, 0.125);
  EXPECT_FALSE(s.on);
  EXPECT_EQ(s.name, "a b");
  EXPECT_EQ(s.mode, "slow");
  EXPECT_EQ(s.color, Color::kBlue);
  EXPECT_EQ(s.inner.depth, 5);
  EXPECT_EQ(s.inner.tile, 256);
  // The struct serialises itself, and the text reads back to the same values
  // (the same text again).
  auto yaml = t.ToYaml(s);
  ASSERT_TRUE(yaml.ok()) << yaml.status().ToString();
  EXPECT_NE(yaml->find("# The name.\nname: \"a b\"\n"), std::string::npos) << *yaml;
  auto back = LoadConfigText(t.Schema(), *yaml, "sample.yml", {});
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  Sample r;
  EXPECT_TRUE(t.Read(*back, &r).empty());
  EXPECT_EQ(r.count, 12);
  EXPECT_EQ(r.rate, 0.125);
  EXPECT_EQ(r.name, "a b");
  EXPECT_EQ(r.color, Color::kBlue);
  EXPECT_EQ(r.inner.tile, 256);
  EXPECT_EQ(*t.ToYaml(r), *yaml);
  // A value that needs every digit survives the trip.
  s.rate = 0.1 + 0.2;
  auto again = LoadConfigText(t.Schema(), *t.ToYaml(s), "sample.yml", {});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->GetFloat("rate"), 0.1 + 0.2);
  // -1 is an unset optional.
  s.inner.tile.reset();
  EXPECT_EQ(t.ToConfig(s)->GetInt("inner_tile"), -1);
}

TEST(FlagTable, RangesNameTheFlagAndStillSetTheField) {
  const FlagTable<Sample> t = SampleFlags();
  auto c = LoadConfig(t.Schema(), "", {"count=0", "seed=-3", "rate=1", "inner_depth=0"});
  ASSERT_TRUE(c.ok());
  Sample s;
  const std::vector<std::string> p = t.Read(*c, &s);
  EXPECT_EQ(p, (std::vector<std::string>{"count=0 must be in [1, 100]",
                                         "seed must not be negative",
                                         "rate=1 must be between 0 and 1 (exclusive): a share",
                                         "inner_depth=0 must be at least 1"}));
  EXPECT_EQ(s.count, 0);
  EXPECT_EQ(CheckFlagRange("x", 0, "0", {.min = 0, .min_open = true}), "x must be positive");
  EXPECT_EQ(CheckFlagRange("x", 1, "1", {.min = 0, .max = 1, .max_open = true}),
            "x must be in [0, 1)");
  EXPECT_EQ(CheckFlagRange("x", 1e7, "1e+07", {.min = 1, .max = 1e6, .show_value = true}),
            "x=1e+07 must be in [1, 1000000]");
  EXPECT_EQ(CheckFlagRange("x", 5, "5", {.max = 4}), "x must be at most 4");
  EXPECT_EQ(CheckFlagRange("x", 0.5, "0.5", {.min = 0.75, .phrase = "must be big"}),
            "x must be big");
  EXPECT_EQ(CheckFlagRange("x", 0.5, "0.5", {.min = 0, .max = 1}), "");
  EXPECT_EQ(CheckFlagRange("x", -1, "-1", {}), "");
}

TEST(FlagTable, UnknownKeysSuggestTheClosestFlag) {
  auto c = LoadConfig(SampleFlags().Schema(), "", {"cuont=3"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("did you mean 'count'?"), std::string::npos)
      << c.status().message();
  c = LoadConfig(SampleFlags().Schema(), "", {"color=bleu"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("did you mean 'blue'?"), std::string::npos)
      << c.status().message();
}

TEST(FlagTable, AValueNoFlagExpressesIsAnErrorNamingTheFlag) {
  Sample s;
  s.color = static_cast<Color>(7);
  auto c = SampleFlags().ToConfig(s);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'color'"), std::string::npos) << c.status().message();
  // A name the flag's choices do not list (a Config of a schema without
  // choices) is a problem naming the fix.
  ConfigSchema loose;
  ASSERT_TRUE(SampleFlags().AddTo(&loose).ok());
  ConfigSchema bare;
  for (FlagSpec f : loose.flags()) {
    f.choices.clear();
    ASSERT_TRUE(bare.Add(f).ok());
  }
  auto cfg = LoadConfig(bare, "", {"color=pink"});
  ASSERT_TRUE(cfg.ok());
  Sample r;
  EXPECT_EQ(SampleFlags().Read(*cfg, &r),
            (std::vector<std::string>{
                "color='pink' is not supported; set color=red, color=green or color=blue"}));
  // AddTo refuses a name that is taken.
  EXPECT_FALSE(SampleFlags().AddTo(&loose).ok());
}

TEST(FlagTable, ARowAddedToATableIsInItsSchemaAndItsDocumentedYaml) {
  FlagTable<Sample> t = SampleFlags();
  const std::string before = t.DocumentedYaml();
  EXPECT_EQ(before.find("added_flag"), std::string::npos);
  EXPECT_NE(before.find("\n# ---------------------------------------------------------------"
                        "------------\n# Switches\n# and names\n# ---"),
            std::string::npos)
      << before;
  EXPECT_NE(before.find("\n# The color. One of: red, green, blue.\ncolor: green\n"),
            std::string::npos)
      << before;
  t.Float("added_flag", &Sample::rate, "A flag added in one row.");
  const std::string after = t.DocumentedYaml();
  EXPECT_NE(after.find("\n# A flag added in one row.\nadded_flag: 0.5\n"), std::string::npos)
      << after;
  const ConfigSchema schema = t.Schema();
  EXPECT_NE(schema.Find("added_flag"), nullptr);
  // The documented YAML is a config file of its own flags.
  auto c = LoadConfigText(schema, after, "documented.yml", {});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  for (const FlagSpec& f : schema.flags()) EXPECT_TRUE(c->IsSet(f.name)) << f.name;
}

}  // namespace
}  // namespace fp8moe
