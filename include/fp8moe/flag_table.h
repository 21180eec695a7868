// Flag tables: a typed configuration struct bound to its flags, each flag
// declared once.
//
// A FlagTable<S> lists the flags of struct S in order. Each row binds a
// flag's name (MaxText's where it has one), its type, a one-line doc, its
// range or choices, and the field of S it sets. A flag's default is that
// field's own initializer, read off a default-constructed S, so the struct
// and its flags cannot disagree. Everything else comes from the table:
//   Schema()         the ConfigSchema: LoadConfig parses and type-checks the
//                    values and suggests the closest name for an unknown key;
//   Read()           a Config's values into an S, naming each value outside
//                    its range;
//   ToConfig(s)      s written back as a Config: ToYaml() of it is what
//                    checkpoints store and the ranks fingerprint, and
//                    LoadConfig reads it back to the same S;
//   DocumentedYaml() the defaults with their docs, in sections (base.yml).
// A larger struct nests a smaller one's table (Nest), so a flag keeps its one
// row however many schemas hold it. Adding a flag is one row plus its use.
#ifndef FP8MOE_FLAG_TABLE_H_
#define FP8MOE_FLAG_TABLE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fp8moe/config.h"
#include "fp8moe/status.h"

namespace fp8moe {

// The interval a numeric flag's value must lie in. A value outside reads
// "<name> must be <phrase><note>", or "<name>=<value> must be ..." with
// show_value: "must not be negative" ([0, inf)), "must be positive"
// ((0, inf)), "must be at least 1", "must be in [0, 1)", "must be between 0
// and 1 (exclusive)".
struct FlagRange {
  std::optional<double> min = {}, max = {};
  bool min_open = false, max_open = false;
  bool show_value = false;
  std::string phrase = {};  // replaces the generated phrase ("must be at least 1.2e-38")
  std::string note = {};    // appended to the phrase, e.g. " (0: only at the end)"

  bool empty() const { return !min && !max; }
};

// "" when `value` lies in `range`, else the problem as described at
// FlagRange; `value_text` is the value as the message shows it.
std::string CheckFlagRange(const std::string& name, double value,
                           const std::string& value_text, const FlagRange& range);

// A value as a `key=value` override writes it, reading back to the same
// value: "true", "42", the shortest decimal of a double ("0.003", "1e-08").
std::string FlagText(bool v);
std::string FlagText(int64_t v);
std::string FlagText(double v);

// "name='text' is not supported; set name=a or name=b": a name no choice of
// the flag `name` in `c` maps (a Config of another schema, without choices).
std::string UnsupportedChoice(const std::string& name, const std::string& text,
                              const std::vector<std::string>& choices);

// Aborts with "fp8moe: <where>: <message>" if `s` is an error: a flag table
// that the schema refuses is a bug of the table, not of the user's input.
void DieIfError(const Status& s, const char* where);

// The flags of `values` at their values, each under its doc as wrapped
// comments (79 columns, choices listed), a section header before flag i
// where sections[i] is not empty; FlagTable::DocumentedYaml's text.
std::string DocumentedYamlOf(const ConfigSchema& schema, const Config& values,
                             const std::vector<std::string>& sections);

// One flag of a FlagTable<S>.
template <class S>
struct FlagRow {
  FlagSpec spec;  // default_value is left empty: Schema() takes it from S{}
  FlagRange range = {};
  std::string section = {};     // non-empty: a base.yml section starts here
  bool resume_neutral = false;  // bookkeeping: not compared when a run resumes
  // Sets the field from the flag's value in `c`; "" or the problem (a range
  // problem still sets the field, so a struct holds what the user wrote).
  std::function<std::string(const Config& c, S& s)> read;
  // The field's value as text that Config::Set reads back to it.
  std::function<std::string(const S& s)> write;

  // Marks the flag as bookkeeping (output names, periods, the rank layout):
  // a resumed run may change it without a warning.
  FlagRow& ResumeNeutral() {
    resume_neutral = true;
    return *this;
  }
};

// The field `inner` of the member `outer` gives: an accessor for a nested
// struct's field, e.g. Field(&TrainConfig::model, &ModelConfig::emb_dim).
// `outer` may itself be such an accessor.
template <class Outer, class Inner>
constexpr auto Field(Outer outer, Inner inner) {
  return [outer, inner](auto& s) -> auto& { return std::invoke(outer, s).*inner; };
}

template <class S>
class FlagTable {
 public:
  // The type of the field accessor `at` (a member pointer of S or a
  // callable S& -> T&, such as Field) gives.
  template <class At>
  using FieldType = std::remove_cvref_t<std::invoke_result_t<At, S&>>;

  // The next row starts a section of base.yml titled `title` ('\n' breaks
  // the title's lines).
  FlagTable& Section(std::string title) {
    pending_section_ = std::move(title);
    return *this;
  }

  template <class At>
  FlagRow<S>& Bool(std::string name, At at, std::string doc) {
    return Add(Spec(std::move(name), FlagType::kBool, std::move(doc)), {},
               [at](const Config& c, S& s, const std::string& name, const FlagRange& range) {
                 std::invoke(at, s) = c.GetBool(name);
                 return std::string();
               },
               [at](const S& s) { return FlagText(static_cast<bool>(std::invoke(at, s))); });
  }

  // An integer field (int64_t, or uint64_t with a range from 0).
  template <class At>
  FlagRow<S>& Int(std::string name, At at, std::string doc, FlagRange range = {}) {
    using T = FieldType<At>;
    static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
    return Add(Spec(std::move(name), FlagType::kInt, std::move(doc)), std::move(range),
               [at](const Config& c, S& s, const std::string& name, const FlagRange& range) {
                 const int64_t v = c.GetInt(name);
                 std::invoke(at, s) = static_cast<T>(v);
                 return CheckFlagRange(name, static_cast<double>(v), FlagText(v),
                                       range);
               },
               [at](const S& s) { return FlagText(static_cast<int64_t>(std::invoke(at, s))); });
  }

  // An integer flag of an optional field: -1 means unset (std::nullopt).
  template <class At>
  FlagRow<S>& OptionalInt(std::string name, At at, std::string doc) {
    return Add(Spec(std::move(name), FlagType::kInt, std::move(doc)), {},
               [at](const Config& c, S& s, const std::string& name, const FlagRange& range) {
                 const int64_t v = c.GetInt(name);
                 std::invoke(at, s) = v == -1 ? std::nullopt : std::optional<int64_t>(v);
                 return std::string();
               },
               [at](const S& s) { return FlagText(std::invoke(at, s).value_or(-1)); });
  }

  template <class At>
  FlagRow<S>& Float(std::string name, At at, std::string doc, FlagRange range = {}) {
    return Add(Spec(std::move(name), FlagType::kFloat, std::move(doc)), std::move(range),
               [at](const Config& c, S& s, const std::string& name, const FlagRange& range) {
                 const double v = c.GetFloat(name);
                 std::invoke(at, s) = v;
                 return CheckFlagRange(name, v, FlagText(v), range);
               },
               [at](const S& s) { return FlagText(static_cast<double>(std::invoke(at, s))); });
  }

  // A string field; `choices` (if any) are its only values ("" may be one).
  template <class At>
  FlagRow<S>& String(std::string name, At at, std::string doc,
                     std::vector<std::string> choices = {}) {
    FlagSpec spec = Spec(std::move(name), FlagType::kString, std::move(doc));
    spec.choices = std::move(choices);
    return Add(std::move(spec), {},
               [at](const Config& c, S& s, const std::string& name, const FlagRange& range) {
                 std::invoke(at, s) = c.GetString(name);
                 return std::string();
               },
               [at](const S& s) { return std::string(std::invoke(at, s)); });
  }

  // An enum field set by name: `names` pairs each choice of the string flag
  // with its value, in the order the choices are listed.
  template <class At>
  FlagRow<S>& Enum(std::string name, At at, std::string doc,
                   std::vector<std::pair<std::string, FieldType<At>>> names) {
    std::vector<std::string> choices;
    for (const auto& n : names) choices.push_back(n.first);
    FlagSpec spec = Spec(std::move(name), FlagType::kString, std::move(doc));
    spec.choices = choices;
    return Add(std::move(spec), {},
               [at, names, choices](const Config& c, S& s, const std::string& name,
                                    const FlagRange&) {
                 const std::string& text = c.GetString(name);
                 for (const auto& [n, v] : names) {
                   if (n == text) {
                     std::invoke(at, s) = v;
                     return std::string();
                   }
                 }
                 return UnsupportedChoice(name, text, choices);
               },
               [at, names](const S& s) {
                 for (const auto& [n, v] : names) {
                   if (v == std::invoke(at, s)) return n;
                 }
                 // No choice names the value: Config::Set refuses this text,
                 // naming the flag and its choices.
                 return std::string("<a value no choice names>");
               });
  }

  // A flag with its own conversion: `read` sets the field from the flag's
  // value in a Config and returns "" or the problem; `write` is the inverse.
  FlagRow<S>& Custom(FlagSpec spec, std::function<std::string(const Config&, S&)> read,
                     std::function<std::string(const S&)> write) {
    return Add(std::move(spec), {},
               [read](const Config& c, S& s, const std::string&, const FlagRange&) {
                 return read(c, s);
               },
               std::move(write));
  }

  // Every row of `inner`, bound to the member `at` gives (a pending Section
  // goes to its first row).
  template <class At, class Inner>
  FlagTable& Nest(At at, const FlagTable<Inner>& inner) {
    for (const FlagRow<Inner>& r : inner.rows()) {
      FlagRow<S> row;
      row.spec = r.spec;
      row.range = r.range;
      row.section = r.section;
      row.resume_neutral = r.resume_neutral;
      auto read = r.read;
      auto write = r.write;
      row.read = [at, read](const Config& c, S& s) { return read(c, std::invoke(at, s)); };
      row.write = [at, write](const S& s) { return write(std::invoke(at, s)); };
      Push(std::move(row));
    }
    return *this;
  }

  const std::vector<FlagRow<S>>& rows() const { return rows_; }

  // The flags, each with the value `defaults` holds as its default. A row
  // the schema refuses (a name taken twice, a default outside its choices)
  // is a bug of the table: it aborts with the message.
  ConfigSchema Schema(const S& defaults = S{}) const {
    ConfigSchema schema;
    for (const FlagRow<S>& r : rows_) {
      FlagSpec spec = r.spec;
      spec.default_value = r.write(defaults);
      DieIfError(schema.Add(std::move(spec)), "FlagTable::Schema");
    }
    return schema;
  }

  // Adds the flags (defaults from S{}) to a larger schema; fails if a name
  // is taken.
  Status AddTo(ConfigSchema* schema) const {
    const S defaults{};
    for (const FlagRow<S>& r : rows_) {
      FlagSpec spec = r.spec;
      spec.default_value = r.write(defaults);
      FP8MOE_RETURN_IF_ERROR(schema->Add(std::move(spec)));
    }
    return OkStatus();
  }

  // Sets every bound field of *s from `c`, which must hold every flag of the
  // table with its type (e.g. from LoadConfig with Schema(); extra flags are
  // ignored). Returns the problems (values outside their range, names no
  // choice maps), in row order; fields no row binds keep their values.
  std::vector<std::string> Read(const Config& c, S* s) const {
    std::vector<std::string> problems;
    for (const FlagRow<S>& r : rows_) {
      std::string p = r.read(c, *s);
      if (!p.empty()) problems.push_back(std::move(p));
    }
    return problems;
  }

  // s as a Config of Schema(): every flag set to the field's value. Fails if
  // a field holds what its flag cannot express (an enum value no choice
  // names, a string that is not UTF-8), naming the flag.
  Result<Config> ToConfig(const S& s) const {
    Config c(Schema());
    for (const FlagRow<S>& r : rows_) {
      FP8MOE_RETURN_IF_ERROR(c.Set(r.spec.name, r.write(s), "the typed configuration"));
    }
    return c;
  }

  // ToConfig(s).ToYaml(): every flag with its doc; LoadConfig reads it back.
  Result<std::string> ToYaml(const S& s) const {
    FP8MOE_ASSIGN_OR_RETURN(const Config c, ToConfig(s));
    return c.ToYaml();
  }

  // Every flag at its default (`defaults`'s value) under its doc comment
  // (wrapped at 79 columns; choices listed), in sections: base.yml's body.
  std::string DocumentedYaml(const S& defaults = S{}) const {
    std::vector<std::string> sections;
    for (const FlagRow<S>& r : rows_) sections.push_back(r.section);
    const ConfigSchema schema = Schema(defaults);
    return DocumentedYamlOf(schema, Config(schema), sections);
  }

 private:
  // Reads the flag `name` (with its range) from a Config into the field.
  using Reader = std::function<std::string(const Config&, S&, const std::string& name,
                                           const FlagRange& range)>;

  static FlagSpec Spec(std::string name, FlagType type, std::string doc) {
    FlagSpec spec;
    spec.name = std::move(name);
    spec.type = type;
    spec.doc = std::move(doc);
    return spec;
  }

  FlagRow<S>& Add(FlagSpec spec, FlagRange range, Reader read,
                  std::function<std::string(const S&)> write) {
    FlagRow<S> row;
    row.spec = std::move(spec);
    row.range = std::move(range);
    row.write = std::move(write);
    // The reader keeps its own copy of the flag's name and range.
    row.read = [read, name = row.spec.name, r = row.range](const Config& c, S& s) {
      return read(c, s, name, r);
    };
    Push(std::move(row));
    return rows_.back();
  }

  void Push(FlagRow<S> row) {
    if (!pending_section_.empty()) {
      row.section = std::move(pending_section_);
      pending_section_.clear();
    }
    rows_.push_back(std::move(row));
  }

  std::vector<FlagRow<S>> rows_;
  std::string pending_section_;
};

}  // namespace fp8moe

#endif  // FP8MOE_FLAG_TABLE_H_
