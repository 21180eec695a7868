// The non-template parts of flag tables (include/fp8moe/flag_table.h): range
// messages, the text of values, and base.yml's layout.
#include "fp8moe/flag_table.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/number_text.h"

namespace fp8moe {
namespace {

// A bound as a message shows it: whole numbers without an exponent
// ("1000000", not "1e+06"), others as their shortest decimal.
std::string BoundText(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.0f", v);
    return buf;
  }
  return internal::ShortestDecimal(v);
}

// "must not be negative", "must be in [0, 1)", ... (FlagRange).
std::string RangePhrase(const FlagRange& r) {
  if (r.min && r.max) {
    const std::string a = BoundText(*r.min), b = BoundText(*r.max);
    if (r.min_open && r.max_open) return "must be between " + a + " and " + b + " (exclusive)";
    return std::string("must be in ") + (r.min_open ? "(" : "[") + a + ", " + b +
           (r.max_open ? ")" : "]");
  }
  if (r.min) {
    if (*r.min == 0) return r.min_open ? "must be positive" : "must not be negative";
    return (r.min_open ? "must be above " : "must be at least ") + BoundText(*r.min);
  }
  return (r.max_open ? "must be below " : "must be at most ") + BoundText(*r.max);
}

// "# "-prefixed lines of `text` wrapped at 79 columns.
std::string Comment(const std::string& text) {
  std::string out, line;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t sp = text.find(' ', i);
    const std::string word = text.substr(i, sp == std::string::npos ? std::string::npos : sp - i);
    if (!line.empty() && line.size() + 1 + word.size() > 77) {
      out += "# " + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
    if (sp == std::string::npos) break;
    i = sp + 1;
  }
  if (!line.empty()) out += "# " + line + "\n";
  return out;
}

// A section's title between two rules; '\n' in the title breaks its lines.
std::string Header(const std::string& title) {
  std::string out = "# ---------------------------------------------------------------------------\n";
  size_t i = 0;
  while (true) {
    const size_t nl = title.find('\n', i);
    out += "# " + title.substr(i, nl == std::string::npos ? std::string::npos : nl - i) + "\n";
    if (nl == std::string::npos) break;
    i = nl + 1;
  }
  return out + "# ---------------------------------------------------------------------------\n";
}

}  // namespace

std::string CheckFlagRange(const std::string& name, double value,
                           const std::string& value_text, const FlagRange& range) {
  if (range.empty()) return "";
  const bool low = range.min && (range.min_open ? !(value > *range.min) : !(value >= *range.min));
  const bool high = range.max && (range.max_open ? !(value < *range.max) : !(value <= *range.max));
  if (!low && !high) return "";
  return name + (range.show_value ? "=" + value_text : std::string()) + " " +
         (range.phrase.empty() ? RangePhrase(range) : range.phrase) + range.note;
}

std::string FlagText(bool v) { return v ? "true" : "false"; }
std::string FlagText(int64_t v) { return std::to_string(v); }
std::string FlagText(double v) { return internal::ShortestDecimal(v); }

std::string UnsupportedChoice(const std::string& name, const std::string& text,
                              const std::vector<std::string>& choices) {
  std::string fix;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) fix += i + 1 == choices.size() ? " or " : ", ";
    fix += name + "=" + (choices[i].empty() ? "''" : choices[i]);
  }
  return name + "='" + text + "' is not supported; set " + fix;
}

void DieIfError(const Status& s, const char* where) {
  if (s.ok()) return;
  std::fprintf(stderr, "fp8moe: %s: %s\n", where, s.ToString().c_str());
  std::abort();
}

std::string DocumentedYamlOf(const ConfigSchema& schema, const Config& values,
                             const std::vector<std::string>& sections) {
  std::string out;
  const std::vector<FlagSpec>& flags = schema.flags();
  for (size_t i = 0; i < flags.size(); ++i) {
    const FlagSpec& f = flags[i];
    if (i < sections.size() && !sections[i].empty()) out += "\n" + Header(sections[i]);
    std::string doc = f.doc;
    if (!f.choices.empty()) {
      std::string c;
      for (const std::string& x : f.choices) c += (c.empty() ? "" : ", ") + (x.empty() ? "\"\"" : x);
      doc += " One of: " + c + ".";
    }
    // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "\n" + string.
    out += '\n';
    out += Comment(doc);
    out += f.name;
    out += ": ";
    out += values.ValueYaml(f.name);
    out += '\n';
  }
  return out;
}

}  // namespace fp8moe
