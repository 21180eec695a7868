#include "fp8moe/config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <system_error>
#include <vector>

#include "io/flat_yaml.h"

namespace fp8moe {
namespace {

// Same type as Config::Value (a private alias there).
using FlagValue = std::variant<bool, int64_t, double, std::string>;

// Optimal string alignment distance: Levenshtein plus adjacent swaps, which
// are the commonest typo ("nmu_experts").
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> before(b.size() + 1), prev(b.size() + 1),
      cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        cur[j] = std::min(cur[j], before[j - 2] + 1);
      }
    }
    std::swap(before, prev);
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Schemas with at most this many keys list them all in an unknown-key error;
// larger ones (the trainer's) point at the file that documents them.
constexpr size_t kMaxListedKeys = 16;

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "fp8moe: %s\n", message.c_str());
  std::abort();
}

const char* TypeName(FlagType type) {
  switch (type) {
    case FlagType::kBool:
      return "bool";
    case FlagType::kInt:
      return "integer";
    case FlagType::kFloat:
      return "float";
    case FlagType::kString:
      return "string";
  }
  return "unknown";
}

// What a value of `type` must look like, for "expected ..." in messages.
const char* Expectation(FlagType type) {
  switch (type) {
    case FlagType::kBool:
      return "true or false (True and False also work)";
    case FlagType::kInt:
      return "a whole number such as 8";
    case FlagType::kFloat:
      return "a finite number such as 0.5 or 1e-5";
    case FlagType::kString:
      return "a string";
  }
  return "?";
}

std::string Where(std::string_view source) {
  return source.empty() ? std::string() : " in " + std::string(source);
}

// Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "'" + string.
std::string Quoted(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out += '\'';
  out += s;
  out += '\'';
  return out;
}

std::string Join(const std::vector<std::string>& items, bool quote) {
  std::string out;
  for (const std::string& item : items) {
    if (!out.empty()) out += ", ";
    out += quote ? Quoted(item) : item;
  }
  return out;
}

Status UnknownKey(std::string_view key, std::string_view source,
                  const std::vector<std::string>& names) {
  // A key of a few hundred bytes or more is shown by its start and length.
  constexpr size_t kShown = 80;
  size_t cut = std::min(kShown, key.size());
  while (cut < key.size() && cut > 0 && (static_cast<unsigned char>(key[cut]) & 0xC0) == 0x80) {
    --cut;  // at a character boundary
  }
  std::string shown = cut == key.size() ? Quoted(key)
                                        : Quoted(key.substr(0, cut)) + "... (" +
                                              std::to_string(key.size()) + " bytes)";
  std::string message = "unknown key " + shown + Where(source);
  const std::string guess = SuggestClosest(key, names);
  if (!guess.empty()) {
    message += "; did you mean " + Quoted(guess) + "?";
  } else if (names.empty()) {
    message += "; this config has no keys";
  } else if (names.size() <= kMaxListedKeys) {
    message += "; valid keys: " + Join(names, /*quote=*/false);
  } else {
    message += "; see configs/base.yml for the list of keys";
  }
  return InvalidArgument(std::move(message));
}

// from_chars accepts no leading '+', but people write "+1" and "+0.5".
std::string_view StripPlus(std::string_view s) {
  if (s.size() > 1 && s[0] == '+' && s[1] != '+' && s[1] != '-') {
    s.remove_prefix(1);
  }
  return s;
}

// Parses `text` as a value of `spec`, checking its choices.
Result<FlagValue> ParseValue(const FlagSpec& spec, std::string_view text,
                             std::string_view source) {
  const std::string bad = "invalid value " + Quoted(text) + " for " +
                          TypeName(spec.type) + " key " + Quoted(spec.name) +
                          Where(source) + ": ";
  switch (spec.type) {
    case FlagType::kBool:
      // YAML 1.1's yes/no/on/off are deliberately refused: too easy to misread.
      if (text == "true" || text == "True") return FlagValue(true);
      if (text == "false" || text == "False") return FlagValue(false);
      return InvalidArgument(bad + "expected " + Expectation(spec.type));
    case FlagType::kInt: {
      const std::string_view s = StripPlus(text);
      int64_t v = 0;
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
      if (ec == std::errc::result_out_of_range) {
        return InvalidArgument(
            bad + "out of range; expected a whole number from " +
            std::to_string(std::numeric_limits<int64_t>::min()) + " to " +
            std::to_string(std::numeric_limits<int64_t>::max()));
      }
      if (ec != std::errc() || end != s.data() + s.size()) {
        return InvalidArgument(bad + "expected " + Expectation(spec.type));
      }
      return FlagValue(v);
    }
    case FlagType::kFloat: {
      const std::string_view s = StripPlus(text);
      double v = 0;
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
      if (ec == std::errc::result_out_of_range) {
        return InvalidArgument(bad + "out of range for a double");
      }
      if (ec != std::errc() || end != s.data() + s.size()) {
        return InvalidArgument(bad + "expected " + Expectation(spec.type));
      }
      // from_chars reads "inf" and "nan"; no flag has a use for them, and a
      // NaN learning rate is better caught here than a thousand steps later.
      if (!std::isfinite(v)) {
        return InvalidArgument(bad +
                               "expected a finite number (inf and nan are not "
                               "allowed)");
      }
      return FlagValue(v);
    }
    case FlagType::kString: {
      // A config is written back as YAML (ToYaml, checkpoints), which is
      // Unicode text: bytes that are not UTF-8, or a NUL, could not load back.
      if (!IsValidUtf8(text)) {
        return InvalidArgument(bad + "not valid UTF-8 text; write the value as UTF-8");
      }
      if (text.find('\0') != std::string_view::npos) {
        return InvalidArgument(bad + "a NUL character is not allowed");
      }
      if (spec.choices.empty() ||
          std::find(spec.choices.begin(), spec.choices.end(), text) !=
              spec.choices.end()) {
        return FlagValue(std::string(text));
      }
      std::string message =
          bad + "expected one of " + Join(spec.choices, /*quote=*/true);
      const std::string guess = SuggestClosest(text, spec.choices);
      if (!guess.empty()) message += "; did you mean " + Quoted(guess) + "?";
      return InvalidArgument(std::move(message));
    }
  }
  return Internal("unhandled flag type");
}

// True if `s` reads back from YAML as the same string without quotes, even in
// YAML 1.1 readers (which would turn yes/no/on/off into bools).
bool IsPlainYamlSafe(std::string_view s) {
  if (s.empty()) return false;
  const unsigned char first = s[0];
  if (!std::isalpha(first) && first != '_') return false;
  for (const unsigned char c : s) {
    if (!std::isalnum(c) && c != '_' && c != '-' && c != '.' && c != '/') {
      return false;
    }
  }
  std::string lower(s);
  for (char& c : lower) c = static_cast<char>(std::tolower(c));
  for (const char* word :
       {"null", "true", "false", "yes", "no", "on", "off", "y", "n"}) {
    if (lower == word) return false;
  }
  return true;
}

// `s` as a YAML scalar: plain where safe, else double-quoted with escapes for
// every character YAML does not allow raw (C0 and C1 controls, U+FFFE and
// U+FFFF) or that YAML 1.1 readers take as a line break (U+0085, U+2028,
// U+2029), so that the flat reader (io/flat_yaml.h) and other YAML readers
// load back the same string. `s` is UTF-8 (ParseValue checks string values).
std::string YamlString(std::string_view s) {
  if (IsPlainYamlSafe(s)) return std::string(s);
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    size_t len = DecodeUtf8(s, i, &cp);
    if (len == 0) {  // not UTF-8 (ParseValue refuses it): the byte as it is
      out += s[i++];
      continue;
    }
    char buf[16];
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == '"') {
      out += "\\\"";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x20 || (cp >= 0x7F && cp < 0xA0)) {
      std::snprintf(buf, sizeof(buf), "\\x%02X", static_cast<unsigned>(cp));
      out += buf;
    } else if (cp == 0x2028 || cp == 0x2029 || cp == 0xFFFE || cp == 0xFFFF) {
      std::snprintf(buf, sizeof(buf), "\\u%04X", static_cast<unsigned>(cp));
      out += buf;
    } else {
      out.append(s.substr(i, len));
    }
    i += len;
  }
  return out + "\"";
}

std::string ValueToYaml(const FlagValue& value) {
  if (const bool* b = std::get_if<bool>(&value)) return *b ? "true" : "false";
  if (const int64_t* i = std::get_if<int64_t>(&value))
    return std::to_string(*i);
  if (const double* d = std::get_if<double>(&value)) {
    // Shortest text that parses back to the same double.
    char buf[64];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), *d);
    return std::string(buf, end);
  }
  return YamlString(std::get<std::string>(value));
}

}  // namespace

Result<std::string> ReadConfigFile(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) {
    return NotFound("config file '" + path + "' does not exist");
  }
  if (std::filesystem::is_directory(status)) {
    return InvalidArgument("config file '" + path + "' is a directory");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return IoError("cannot open config file '" + path +
                   "': " + std::strerror(errno));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return IoError("cannot read config file '" + path + "'");
  return text.str();
}

namespace {

// Reads the flat key: value file `text` (named `path` in messages) into
// config: every key must be in the schema, given once, with a flat value.
Status ApplyYaml(const ConfigSchema& schema, const std::string& path,
                 const std::string& text, Config* config) {
  FP8MOE_ASSIGN_OR_RETURN(const std::vector<FlatYamlEntry> entries, ParseFlatYaml(text, path));
  std::vector<std::string> names;
  for (const FlagSpec& spec : schema.flags()) names.push_back(spec.name);
  std::map<std::string, int64_t, std::less<>> seen_line;
  for (const FlatYamlEntry& entry : entries) {
    const std::string& key = entry.key;
    const std::string where = path + " line " + std::to_string(entry.line);
    if (auto [it, inserted] = seen_line.emplace(key, entry.line); !inserted) {
      return InvalidArgument("key " + Quoted(key) + " is set twice in " + path + " (lines " +
                             std::to_string(it->second) + " and " +
                             std::to_string(entry.line) + ")");
    }
    const FlagSpec* spec = schema.Find(key);
    if (spec == nullptr) return UnknownKey(key, where, names);
    switch (entry.kind) {
      case FlatYamlEntry::Kind::kNestedMapping:
      case FlatYamlEntry::Kind::kNestedSequence:
        return InvalidArgument(
            "key " + Quoted(key) + " in " + where + " has a nested " +
            (entry.kind == FlatYamlEntry::Kind::kNestedMapping ? "mapping" : "sequence") +
            " as its value; config files are flat key: value mappings and " +
            "this key expects " + Expectation(spec->type));
      case FlatYamlEntry::Kind::kNull:
        // `key:` alone means "empty", which only a string can be.
        if (spec->type != FlagType::kString) {
          return InvalidArgument("key " + Quoted(key) + " in " + where +
                                 " has no value; expected " + Expectation(spec->type));
        }
        FP8MOE_RETURN_IF_ERROR(config->Set(key, "", where));
        break;
      case FlatYamlEntry::Kind::kScalar:
        FP8MOE_RETURN_IF_ERROR(config->Set(key, entry.value, where));
        break;
    }
  }
  return OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------

Status ConfigSchema::Add(FlagSpec spec) {
  if (spec.name.empty()) return InvalidArgument("flag name is empty");
  for (const unsigned char c : spec.name) {
    // '=' would make the flag impossible to override on the command line.
    if (c == '=' || std::isspace(c)) {
      return InvalidArgument("flag name " + Quoted(spec.name) +
                             " contains '=' or whitespace");
    }
  }
  if (index_.count(spec.name)) {
    return InvalidArgument("flag " + Quoted(spec.name) + " is declared twice");
  }
  if (!spec.choices.empty() && spec.type != FlagType::kString) {
    return InvalidArgument("flag " + Quoted(spec.name) +
                           ": choices are only supported for string flags");
  }
  if (Result<FlagValue> v = ParseValue(spec, spec.default_value, ""); !v.ok()) {
    return InvalidArgument("bad default for flag " + Quoted(spec.name) + ": " +
                           v.status().message());
  }
  index_.emplace(spec.name, flags_.size());
  flags_.push_back(std::move(spec));
  return OkStatus();
}

const FlagSpec* ConfigSchema::Find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &flags_[it->second];
}

// ---------------------------------------------------------------------------

Config::Config(const ConfigSchema& schema) {
  entries_.reserve(schema.flags().size());
  for (const FlagSpec& spec : schema.flags()) {
    Result<FlagValue> v = ParseValue(spec, spec.default_value, "");
    // ConfigSchema::Add checked every default, so this cannot fail.
    if (!v.ok()) Die("Config: " + v.status().message());
    index_.emplace(spec.name, entries_.size());
    entries_.push_back(Entry{spec, std::move(v).value(), false});
  }
}

Status Config::Set(std::string_view key, std::string_view value,
                   std::string_view source) {
  const auto it = index_.find(key);
  if (it == index_.end()) {
    std::vector<std::string> names;
    for (const Entry& e : entries_) names.push_back(e.spec.name);
    return UnknownKey(key, source, names);
  }
  Entry& entry = entries_[it->second];
  FP8MOE_ASSIGN_OR_RETURN(entry.value, ParseValue(entry.spec, value, source));
  entry.is_set = true;
  return OkStatus();
}

const Config::Entry& Config::Checked(std::string_view key, FlagType type,
                                     const char* caller) const {
  const auto it = index_.find(key);
  if (it == index_.end()) {
    Die(std::string("Config::") + caller + ": unknown key " + Quoted(key));
  }
  const Entry& entry = entries_[it->second];
  if (entry.spec.type != type) {
    Die(std::string("Config::") + caller + ": key " + Quoted(key) + " is a " +
        TypeName(entry.spec.type) + " flag, not a " + TypeName(type) + " flag");
  }
  return entry;
}

bool Config::GetBool(std::string_view key) const {
  return std::get<bool>(Checked(key, FlagType::kBool, "GetBool").value);
}

int64_t Config::GetInt(std::string_view key) const {
  return std::get<int64_t>(Checked(key, FlagType::kInt, "GetInt").value);
}

double Config::GetFloat(std::string_view key) const {
  return std::get<double>(Checked(key, FlagType::kFloat, "GetFloat").value);
}

const std::string& Config::GetString(std::string_view key) const {
  return std::get<std::string>(
      Checked(key, FlagType::kString, "GetString").value);
}

bool Config::IsSet(std::string_view key) const {
  const auto it = index_.find(key);
  if (it == index_.end()) Die("Config::IsSet: unknown key " + Quoted(key));
  return entries_[it->second].is_set;
}

std::string Config::ValueYaml(std::string_view key) const {
  const auto it = index_.find(key);
  if (it == index_.end()) Die("Config::ValueYaml: unknown key " + Quoted(key));
  return ValueToYaml(entries_[it->second].value);
}

std::string Config::ToYaml() const {
  std::string out;
  for (const Entry& entry : entries_) {
    // A blank line between flags keeps each comment next to its own key.
    if (!out.empty()) out += "\n";
    std::string_view doc = entry.spec.doc;
    while (!doc.empty()) {
      const size_t nl = doc.find('\n');
      const std::string_view line = doc.substr(0, nl);
      out += line.empty() ? "#\n" : "# " + std::string(line) + "\n";
      if (nl == std::string_view::npos) break;
      doc.remove_prefix(nl + 1);
    }
    if (!entry.spec.choices.empty()) {
      std::string choices;
      for (const std::string& c : entry.spec.choices) {
        if (!choices.empty()) choices += ", ";
        choices += YamlString(c);
      }
      out += "# One of: " + choices + "\n";
    }
    out += entry.spec.name + ": " + ValueToYaml(entry.value) + "\n";
  }
  return out;
}

// ---------------------------------------------------------------------------

Result<Config> LoadConfig(const ConfigSchema& schema,
                          const std::string& yaml_path,
                          const std::vector<std::string>& overrides) {
  if (yaml_path.empty()) return LoadConfigText(schema, "", "", overrides);
  FP8MOE_ASSIGN_OR_RETURN(const std::string text, ReadConfigFile(yaml_path));
  return LoadConfigText(schema, text, yaml_path, overrides);
}

Result<Config> LoadConfigText(const ConfigSchema& schema, const std::string& yaml_text,
                              const std::string& source,
                              const std::vector<std::string>& overrides) {
  Config config(schema);
  FP8MOE_RETURN_IF_ERROR(ApplyConfigText(schema, yaml_text, source, overrides, &config));
  return config;
}

Status ApplyConfigText(const ConfigSchema& schema, const std::string& yaml_text,
                       const std::string& source, const std::vector<std::string>& overrides,
                       Config* config) {
  if (!yaml_text.empty()) {
    FP8MOE_RETURN_IF_ERROR(ApplyYaml(schema, source, yaml_text, config));
  }
  for (const std::string& arg : overrides) {
    std::string key, value;
    FP8MOE_RETURN_IF_ERROR(ParseKeyValue(arg, &key, &value));
    FP8MOE_RETURN_IF_ERROR(config->Set(key, value, "command-line override " + Quoted(arg)));
  }
  return OkStatus();
}

Status ParseKeyValue(std::string_view arg, std::string* key,
                     std::string* value) {
  if (arg.empty()) return InvalidArgument("empty setting; write key=value");
  const size_t eq = arg.find('=');
  if (eq == std::string_view::npos) {
    return InvalidArgument("setting " + Quoted(arg) +
                           " has no '='; write key=value, e.g. " +
                           std::string(arg) + "=VALUE");
  }
  if (eq == 0) {
    return InvalidArgument("setting " + Quoted(arg) +
                           " has an empty key; write key=value");
  }
  *key = std::string(arg.substr(0, eq));
  *value = std::string(arg.substr(eq + 1));
  return OkStatus();
}

std::string SuggestClosest(std::string_view name,
                           const std::vector<std::string>& candidates) {
  if (name.empty()) return "";
  const size_t limit = std::max<size_t>(2, name.size() / 3);
  const std::string* best = nullptr;
  size_t best_distance = limit + 1;
  for (const std::string& candidate : candidates) {
    if (candidate.empty()) continue;
    // The distance is at least the difference in length: a key far longer
    // than every flag name (a 1 MiB line) costs nothing to rule out.
    const size_t gap = name.size() > candidate.size() ? name.size() - candidate.size()
                                                       : candidate.size() - name.size();
    if (gap >= best_distance) continue;
    const size_t d = EditDistance(name, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = &candidate;
    }
  }
  return best ? *best : "";
}

}  // namespace fp8moe
