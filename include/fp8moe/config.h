// Typed configuration: a schema of flags (name, type, default, doc, allowed
// values), a Config holding one value per flag, and a loader that applies a
// flat YAML file and then `key=value` overrides. The trainer's schema is
// written out as configs/base.yml; each `fp8moe op` declares a small schema of
// its own. Every user mistake (unknown key, bad value, malformed file) is a
// Status whose message names the key, the value, what was expected and where
// the value came from.
#ifndef FP8MOE_CONFIG_H_
#define FP8MOE_CONFIG_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "fp8moe/status.h"

namespace fp8moe {

enum class FlagType { kBool, kInt, kFloat, kString };

// One flag of a schema. Values are given as text and parsed by type:
//   kBool   "true" / "false" (also "True" / "False")
//   kInt    a whole decimal number in int64 range
//   kFloat  a finite decimal number, e.g. "0.5" or "1e-5"
//   kString any text
struct FlagSpec {
  std::string name;
  FlagType type = FlagType::kString;
  std::string default_value;  // as text, e.g. "true", "8", "0.5", ""
  std::string doc = {};       // one or more lines, written as YAML comments
  // kString only: the allowed values; empty means any. "" may be one of them
  // (e.g. quantization="" means no quantization).
  std::vector<std::string> choices = {};
};

// The set of flags a Config may hold, in declaration order.
class ConfigSchema {
 public:
  // Adds a flag. Fails if the name is empty, contains '=' or whitespace, is
  // already present, if choices are given for a non-string flag, or if the
  // default does not pass the flag's own type and choice checks.
  Status Add(FlagSpec spec);

  // The flag called `name`, or nullptr.
  const FlagSpec* Find(std::string_view name) const;

  // All flags, in the order they were added.
  const std::vector<FlagSpec>& flags() const { return flags_; }

 private:
  std::vector<FlagSpec> flags_;
  std::map<std::string, size_t, std::less<>> index_;
};

// One value per flag of a schema. Copies the schema's flags, so it does not
// depend on the schema outliving it.
class Config {
 public:
  // An empty config with no flags; every Set fails and every Get aborts.
  Config() = default;
  // Every flag of `schema` at its default value; none counts as set.
  explicit Config(const ConfigSchema& schema);

  // Parses `value` by the type of flag `key`, checks it against the flag's
  // choices and stores it. On error nothing changes. `source` says where the
  // value came from (e.g. "config.yml line 3") and is quoted in the error.
  Status Set(std::string_view key, std::string_view value,
             std::string_view source = {});

  // The value of flag `key`. An unknown key or a flag of another type is a
  // programming error: these print a message and abort.
  bool GetBool(std::string_view key) const;
  int64_t GetInt(std::string_view key) const;
  double GetFloat(std::string_view key) const;
  const std::string& GetString(std::string_view key) const;

  // True if `key` was given by a file, an override or Set, false if it still
  // holds its default. Aborts on an unknown key.
  bool IsSet(std::string_view key) const;

  // The value of flag `key` as YAML text: what ToYaml writes after "key: ".
  // Aborts on an unknown key.
  std::string ValueYaml(std::string_view key) const;

  // Every flag with its current value, preceded by its doc (and its choices)
  // as comments, in schema order. LoadConfig reads it back to the same values.
  std::string ToYaml() const;

 private:
  using Value = std::variant<bool, int64_t, double, std::string>;
  struct Entry {
    FlagSpec spec;
    Value value;
    bool is_set = false;
  };
  // The entry for `key` of type `type`; aborts (naming `caller`) otherwise.
  const Entry& Checked(std::string_view key, FlagType type,
                       const char* caller) const;

  std::vector<Entry> entries_;
  std::map<std::string, size_t, std::less<>> index_;
};

// A Config from `schema`'s defaults, then the flat YAML mapping in
// `yaml_path` (skipped when empty), then each "key=value" of `overrides` in
// order, so later settings win. A YAML null (`key:` or `key: ~`) is the empty
// string for a string flag and an error for any other. Duplicate keys in the
// file, nested values, unknown keys and bad values are errors.
Result<Config> LoadConfig(const ConfigSchema& schema,
                          const std::string& yaml_path,
                          const std::vector<std::string>& overrides);

// LoadConfig with the YAML given as text instead of a path; `source` names
// it in messages (as the path would). What LoadConfig does after reading the
// file, so a fuzzer or a caller holding the text in memory gets the same
// checks.
Result<Config> LoadConfigText(const ConfigSchema& schema, const std::string& yaml_text,
                              const std::string& source,
                              const std::vector<std::string>& overrides);

// What LoadConfigText does after making its Config, applied to *config: the
// YAML text (skipped when empty) and then the overrides, so that a caller
// can lay settings over values it set first (a model preset under the
// user's file and flags). On error *config may hold some of the settings.
Status ApplyConfigText(const ConfigSchema& schema, const std::string& yaml_text,
                       const std::string& source, const std::vector<std::string>& overrides,
                       Config* config);

// The text of the config file at `path` (what LoadConfig reads), or an error
// naming the path: missing, a directory, unreadable.
Result<std::string> ReadConfigFile(const std::string& path);

// Splits `arg` at its first '=' into *key and *value ("a=b=c" gives "a" and
// "b=c"; "a=" gives an empty value). Fails if there is no '=' or the key is
// empty.
Status ParseKeyValue(std::string_view arg, std::string* key,
                     std::string* value);

// The candidate closest to `name` by edit distance (insertions, deletions,
// substitutions and swaps of adjacent characters), if that distance is at most
// max(2, name.size() / 3); otherwise "". An empty name matches nothing, empty
// candidates are never suggested, and ties go to the earlier candidate.
std::string SuggestClosest(std::string_view name,
                           const std::vector<std::string>& candidates);

}  // namespace fp8moe

#endif  // FP8MOE_CONFIG_H_
