// A strict reader for the YAML subset of config files: one flat mapping of
// `key: value` lines. It replaces a general YAML parser (yaml-cpp 0.7 looped
// forever on inputs config_fuzz kept finding) with one that does a single
// pass over the bytes, without recursion, so its time is linear in the input.
//
// Accepted (docs/config.md, "Config file syntax"):
//  - UTF-8 text (a leading byte order mark is skipped), LF or CRLF line ends;
//  - blank lines, full-line comments (`# ...`, indented or not) and trailing
//    comments (` # ...`);
//  - an optional `---` before the first key and an optional `...` after the
//    last one;
//  - `key: value` lines with the key at column 1: a plain key (no spaces,
//    not starting with a YAML indicator), then ':' and a space;
//  - values: plain scalars on one line (trailing spaces dropped, `a # b`
//    ends at the comment, `a#b` is kept whole), 'single-quoted' ('' is a
//    quote), "double-quoted" (the YAML escapes, \xXX, \uXXXX, \UXXXXXXXX);
//    `key:` alone, `~` and null / Null / NULL are null.
// A nested value (`[a, b]`, `{a: 1}`, or indented lines / `- item` lines
// after `key:`) is returned as such, so the caller can say which key wanted a
// flat value. Everything else is an InvalidArgument naming the line, the
// column and the fix: anchors, aliases, tags, block scalars, values over
// several lines, tabs outside quotes and comments, several documents, directives, quoted or
// complex keys, a top level that is not a mapping, malformed UTF-8 and
// characters YAML does not allow.
#ifndef FP8MOE_IO_FLAT_YAML_H_
#define FP8MOE_IO_FLAT_YAML_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/status.h"

namespace fp8moe {

struct FlatYamlEntry {
  enum class Kind { kScalar, kNull, kNestedMapping, kNestedSequence };
  std::string key;
  Kind kind = Kind::kScalar;
  std::string value;  // the scalar's text, quotes and escapes resolved
  int64_t line = 0;   // 1-based line of the key
};

// The length (1 to 4) of the well-formed UTF-8 sequence at text[i], with its
// code point in *cp; 0 for a malformed one (overlong, a surrogate, past
// U+10FFFF, truncated). i < text.size().
size_t DecodeUtf8(std::string_view text, size_t i, uint32_t* cp);
// Whether all of text is well-formed UTF-8.
bool IsValidUtf8(std::string_view text);

// Parses `text`, the contents of the config file `source` (used in messages
// only). The entries come in file order, duplicates included. Parsing stops
// after the first nested value (the caller refuses it). An empty file, or one
// of comments only, gives no entries.
Result<std::vector<FlatYamlEntry>> ParseFlatYaml(std::string_view text,
                                                 std::string_view source);

}  // namespace fp8moe

#endif  // FP8MOE_IO_FLAT_YAML_H_
