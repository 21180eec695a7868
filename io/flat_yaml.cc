#include "io/flat_yaml.h"

#include <cstdio>
#include <utility>

namespace fp8moe {
namespace {

using Kind = FlatYamlEntry::Kind;

// Whether code point cp may appear in a YAML stream (YAML 1.2 c-printable:
// tab, LF, CR, printable ASCII, NEL, and the rest of Unicode but C1
// controls, surrogates and U+FFFE/U+FFFF).
bool YamlPrintable(uint32_t cp) {
  if (cp < 0x80) return cp == 0x09 || cp == 0x0A || cp == 0x0D || (cp >= 0x20 && cp < 0x7F);
  if (cp < 0xA0) return cp == 0x85;
  return cp != 0xFFFE && cp != 0xFFFF;
}

}  // namespace

size_t DecodeUtf8(std::string_view text, size_t i, uint32_t* cp) {
  const auto* b = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  const unsigned c = b[i];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t len;
  uint32_t v;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2, v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3, v = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4, v = c & 0x07;
  } else {
    return 0;
  }
  if (i + len > n) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((b[i + k] & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b[i + k] & 0x3F);
  }
  const bool overlong = (len == 3 && v < 0x800) || (len == 4 && v < 0x10000);
  if (overlong || (v >= 0xD800 && v <= 0xDFFF) || v > 0x10FFFF) return 0;
  *cp = v;
  return len;
}

bool IsValidUtf8(std::string_view text) {
  uint32_t cp;
  for (size_t i = 0; i < text.size();) {
    const size_t len = DecodeUtf8(text, i, &cp);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

namespace {

// The byte offset of the first malformed UTF-8 sequence in text (overlong
// forms, surrogates and code points past U+10FFFF included) or of the first
// character YAML does not allow (NUL and other control characters), or -1.
int64_t FirstInvalidUtf8(std::string_view text) {
  uint32_t cp;
  for (size_t i = 0; i < text.size();) {
    const size_t len = DecodeUtf8(text, i, &cp);
    if (len == 0 || !YamlPrintable(cp)) return static_cast<int64_t>(i);
    i += len;
  }
  return -1;
}

bool IsBlank(char c) { return c == ' ' || c == '\t'; }

// Whether s[i] ends a token: the end of the line, a space or a tab.
bool EndsToken(std::string_view s, size_t i) { return i >= s.size() || IsBlank(s[i]); }

std::string_view StripTrailingBlanks(std::string_view s) {
  while (!s.empty() && IsBlank(s.back())) s.remove_suffix(1);
  return s;
}

// Whether s from i on is only blanks, then optionally a comment.
bool OnlyCommentFrom(std::string_view s, size_t i) {
  while (i < s.size() && IsBlank(s[i])) ++i;
  return i == s.size() || s[i] == '#';
}

// s for a message: at most about 60 bytes, cut at a character boundary.
std::string Excerpt(std::string_view s) {
  constexpr size_t kMax = 60;
  if (s.size() <= kMax) return std::string(s);
  size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return std::string(s.substr(0, cut)) + "...";
}

// The fix a message suggests for a value that must be quoted: `key: '...'`
// with the value up to its comment (a '#' after a blank), single-quoted
// (a ' doubled), so that following the advice gives the text as written.
std::string QuoteHint(std::string_view key, std::string_view rest) {
  size_t end = rest.size();
  for (size_t i = 1; i < rest.size(); ++i) {
    if (rest[i] == '#' && IsBlank(rest[i - 1])) {
      end = i;
      break;
    }
  }
  std::string quoted = "'";
  for (char c : StripTrailingBlanks(rest.substr(0, end))) {
    quoted += c;
    if (c == '\'') quoted += '\'';
  }
  quoted += "'";
  return std::string(key) + ": " + Excerpt(quoted);
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | (cp >> 6));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | (cp >> 12));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | (cp >> 18));
    *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// The flow- and block-level indicators that cannot start a plain scalar, and
// what each would mean in YAML; nullptr for other characters.
const char* IndicatorMeaning(char c) {
  switch (c) {
    case '&':
      return "an anchor (&name); anchors and aliases (&name, *name) are not supported";
    case '*':
      return "an alias (*name); anchors and aliases (&name, *name) are not supported";
    case '!':
      return "a tag (!name, !!str); tags are not supported";
    case '|':
    case '>':
      return "a block scalar (| or >); block scalars are not supported";
    case '%':
      return "a directive or a reserved '%'";
    case '@':
    case '`':
      return "a character YAML reserves";
    case ',':
    case ']':
    case '}':
      return "a flow-collection indicator";
    default:
      return nullptr;
  }
}

// One pass over the lines of a config file.
class FlatYamlReader {
 public:
  FlatYamlReader(std::string_view text, std::string_view source)
      : text_(text), source_(source.empty() ? std::string_view("<config text>") : source) {}

  Result<std::vector<FlatYamlEntry>> Read() {
    if (const int64_t at = FirstInvalidUtf8(text_); at >= 0) {
      SeekLineOf(static_cast<size_t>(at));
      char byte[8];
      std::snprintf(byte, sizeof(byte), "0x%02X", static_cast<unsigned char>(text_[at]));
      return InvalidArgument(
          "config file '" + std::string(source_) +
          "' is not valid UTF-8 or holds a character YAML does not allow: byte " + byte +
          " at offset " + std::to_string(at) + " (line " + std::to_string(line_) +
          ", column " + std::to_string(Column(static_cast<size_t>(at))) +
          "); save it as UTF-8 text without control characters");
    }
    size_t pos = 0;
    if (text_.substr(0, 3) == "\xEF\xBB\xBF") pos = 3;  // a byte order mark
    line_ = 0;
    while (pos <= text_.size()) {
      size_t end = text_.find('\n', pos);
      if (end == std::string_view::npos) end = text_.size();
      ++line_;
      line_start_ = pos;
      std::string_view s = text_.substr(pos, end - pos);
      if (!s.empty() && s.back() == '\r') s.remove_suffix(1);
      FP8MOE_RETURN_IF_ERROR(ReadLine(s));
      if (stop_) break;
      pos = end + 1;
    }
    return std::move(entries_);
  }

 private:
  // "SOURCE line L, column C" for byte i of the current line.
  std::string Where(size_t i) const {
    return std::string(source_) + " line " + std::to_string(line_) + ", column " +
           std::to_string(Column(line_start_ + i));
  }
  // Valid YAML that config files do not support.
  Status Unsupported(size_t i, const std::string& what) const {
    return InvalidArgument("config file " + Where(i) + ": " + what);
  }
  // Not YAML at all.
  Status Malformed(size_t i, const std::string& what) const {
    return InvalidArgument("malformed YAML in " + Where(i) + ": " + what);
  }

  // 1-based column of byte `offset` of the text: code points since the line
  // start (UTF-8 continuation bytes do not count).
  size_t Column(size_t offset) const {
    size_t column = 1;
    for (size_t i = line_start_; i < offset; ++i) {
      if ((static_cast<unsigned char>(text_[i]) & 0xC0) != 0x80) ++column;
    }
    return column;
  }

  // Sets line_ and line_start_ to the line holding byte `offset`.
  void SeekLineOf(size_t offset) {
    line_ = 1;
    line_start_ = 0;
    for (size_t i = 0; i < offset; ++i) {
      if (text_[i] == '\n') ++line_, line_start_ = i + 1;
    }
  }

  Status ReadLine(std::string_view s) {
    if (const size_t cr = s.find('\r'); cr != std::string_view::npos) {
      return Malformed(cr, "a carriage return that does not end the line; save the file with "
                           "LF or CRLF line ends");
    }
    // YAML 1.1 readers break lines at these too; this reader does not.
    for (const char* separator : {"\xC2\x85", "\xE2\x80\xA8", "\xE2\x80\xA9"}) {
      if (const size_t at = s.find(separator); at != std::string_view::npos) {
        return Unsupported(at, "a Unicode line separator (U+0085, U+2028 or U+2029); end lines "
                               "with LF, or write the character as an escape in double quotes "
                               "(\\N, \\L, \\P)");
      }
    }
    size_t i = 0;
    while (i < s.size() && s[i] == ' ') ++i;
    if (i < s.size() && s[i] == '\t') {
      const bool blank = OnlyCommentFrom(s, i);
      return Unsupported(i, std::string(blank ? "a tab on a blank or comment line"
                                              : "a tab used for indentation") +
                                " (YAML does not allow tabs there); use spaces, and start "
                                "every key at column 1");
    }
    if (i == s.size() || s[i] == '#') return OkStatus();  // blank or comment
    const bool open = open_key_;
    open_key_ = false;
    if (i > 0) return ReadIndented(s, i, open);
    if (ended_ || (s.substr(0, 3) == "---" && EndsToken(s, 3) && (started_ || !entries_.empty()))) {
      return InvalidArgument("config file " + Where(0) +
                             ": a second YAML document starts here; a config file is one "
                             "key: value mapping (remove the '---' or '...' line, or split "
                             "the file in two)");
    }
    if ((s.substr(0, 3) == "---" || s.substr(0, 3) == "...") && EndsToken(s, 3)) {
      FP8MOE_RETURN_IF_ERROR(NoTab(s, 3, s.find('#')));
    }
    if (s.substr(0, 3) == "---" && EndsToken(s, 3)) {
      if (!OnlyCommentFrom(s, 3)) {
        return Unsupported(4, "content on the '---' line; write the first key on the next line");
      }
      started_ = true;
      return OkStatus();
    }
    if (s.substr(0, 3) == "..." && EndsToken(s, 3)) {
      if (!OnlyCommentFrom(s, 3)) {
        return Unsupported(4, "content on the '...' line; only a comment may follow it");
      }
      ended_ = true;
      return OkStatus();
    }
    if (s[0] == '%') {
      return Unsupported(0, "directives (%YAML, %TAG) are not supported; delete the line");
    }
    if (s[0] == '-' && EndsToken(s, 1)) {
      if (open) return Nested(Kind::kNestedSequence);
      return TopLevel(0);
    }
    if (s[0] == '[') return TopLevel(0);
    if (s[0] == '{') {
      return Unsupported(0, "a flow mapping { }; write one key: value per line instead");
    }
    if (s[0] == '"' || s[0] == '\'') {
      return Unsupported(0, "a quoted key; keys are flag names, written without quotes");
    }
    if ((s[0] == '?' || s[0] == ':') && EndsToken(s, 1)) {
      return Unsupported(0, std::string(s[0] == '?' ? "a complex key ('? ')" : "a key is missing before ':'") +
                                "; write key: value with a flag name as the key");
    }
    if (const char* meaning = IndicatorMeaning(s[0])) {
      return Unsupported(0, std::string("'") + s[0] + "' at the start of a line is " + meaning +
                                "; each line is key: value with a flag name as the key");
    }
    return ReadKeyValue(s);
  }

  // A line that starts with spaces or tabs, after `key:` when `open`.
  Status ReadIndented(std::string_view s, size_t i, bool open) {
    if (open) {
      const FlatYamlEntry& entry = entries_.back();
      if (s[i] == '-' && EndsToken(s, i + 1)) return Nested(Kind::kNestedSequence);
      if (s[i] == '[') return Nested(Kind::kNestedSequence);
      if (s[i] == '{') return Nested(Kind::kNestedMapping);
      if (s[i] == '?' && EndsToken(s, i + 1)) return Nested(Kind::kNestedMapping);
      for (size_t k = i; k < s.size(); ++k) {
        if (s[k] == '#' && IsBlank(s[k - 1])) break;
        if (s[k] == ':' && EndsToken(s, k + 1)) return Nested(Kind::kNestedMapping);
      }
      return Unsupported(i, "the value of '" + entry.key + "' (line " +
                                std::to_string(entry.line) +
                                ") is on the next line; values over several lines are not "
                                "supported: write it on the key's line (" + entry.key +
                                ": value), quoted if needed");
    }
    if (entries_.empty()) {
      return Unsupported(i, "an indented key; start every key at column 1");
    }
    const FlatYamlEntry& entry = entries_.back();
    return Malformed(i, "an indented line after '" + entry.key + "' (line " +
                            std::to_string(entry.line) +
                            "); config files are flat: every key starts at column 1 and "
                            "every value is on its key's line (a value over several lines is "
                            "not supported)");
  }

  // `key: value` at column 1.
  Status ReadKeyValue(std::string_view s) {
    size_t colon = std::string_view::npos;
    for (size_t k = 0; k < s.size(); ++k) {
      if (s[k] == '#' && k > 0 && IsBlank(s[k - 1])) break;
      if (s[k] == ':' && EndsToken(s, k + 1)) {
        colon = k;
        break;
      }
    }
    if (colon == std::string_view::npos) {
      std::string what = "'" + Excerpt(StripTrailingBlanks(s.substr(0, s.find(" #")))) +
                         "' is not a key: value line";
      if (s.find(':') != std::string_view::npos) what += " (put a space after the ':')";
      if (entries_.empty()) {
        return InvalidArgument("config file " + Where(0) +
                               ": the top level must be a mapping of key: value lines; " + what);
      }
      return Malformed(0, what + "; write key: value");
    }
    FP8MOE_RETURN_IF_ERROR(NoTab(s, 0, colon));
    const std::string_view key = StripTrailingBlanks(s.substr(0, colon));
    for (size_t k = 0; k < key.size(); ++k) {
      if (IsBlank(key[k])) {
        return Unsupported(k, "the key '" + std::string(key) +
                                  "' holds a space; keys are flag names such as num_experts");
      }
    }
    FlatYamlEntry entry;
    entry.key = std::string(key);
    entry.line = line_;
    size_t v = colon + 1;
    while (v < s.size() && IsBlank(s[v])) ++v;
    FP8MOE_RETURN_IF_ERROR(NoTab(s, colon, v));
    if (v == s.size() || s[v] == '#') {
      entry.kind = Kind::kNull;  // `key:` alone; indented lines may follow
      entries_.push_back(std::move(entry));
      open_key_ = true;
      return OkStatus();
    }
    const char c = s[v];
    if (c == '[' || c == '{') {
      entry.kind = c == '[' ? Kind::kNestedSequence : Kind::kNestedMapping;
      entries_.push_back(std::move(entry));
      stop_ = true;
      return OkStatus();
    }
    if (c == '"' || c == '\'') {
      size_t after = 0;
      FP8MOE_RETURN_IF_ERROR(c == '"' ? DoubleQuoted(s, v, &entry.value, &after)
                                      : SingleQuoted(s, v, &entry.value, &after));
      FP8MOE_RETURN_IF_ERROR(NoTab(s, after, s.find('#', after)));
      if (after < s.size() && !OnlyCommentFrom(s, after)) {
        return Malformed(after, "text after the closing quote of the value of '" + entry.key +
                                    "'; put it inside the quotes, or start a comment with ' #'");
      }
      if (after < s.size() && s[after] == '#') {
        return Malformed(after, "a comment needs a space before its '#'");
      }
      entries_.push_back(std::move(entry));
      return OkStatus();
    }
    if (c == '-' && EndsToken(s, v + 1)) {
      return Unsupported(v, "a list item ('- ') as the value of '" + entry.key +
                                "'; config files are flat key: value mappings");
    }
    const char* meaning = IndicatorMeaning(c);
    if (meaning == nullptr && (c == '?' || c == ':') && EndsToken(s, v + 1)) {
      meaning = "a mapping indicator";
    }
    if (meaning != nullptr) {
      return Unsupported(v, std::string("the value of '") + entry.key + "' starts with '" + c +
                                "', " + meaning + "; to mean the text itself, quote it: " +
                                QuoteHint(entry.key, s.substr(v)));
    }
    // A plain scalar: up to a comment (a '#' after a blank) or the line end.
    size_t k = v;
    for (; k < s.size(); ++k) {
      if (s[k] == '#' && IsBlank(s[k - 1])) break;
      if (s[k] == '\t') return NoTab(s, k, k + 1);
      if (s[k] == ':' && EndsToken(s, k + 1)) {
        return Malformed(k, "': ' inside the value of '" + entry.key +
                                "' (a nested mapping?); to mean the text itself, quote it: " +
                                QuoteHint(entry.key, s.substr(v)));
      }
    }
    const std::string_view value = StripTrailingBlanks(s.substr(v, k - v));
    if (value == "~" || value == "null" || value == "Null" || value == "NULL") {
      entry.kind = Kind::kNull;
    } else {
      entry.value = std::string(value);
    }
    entries_.push_back(std::move(entry));
    return OkStatus();
  }

  // 'text' at s[v]; '' is one quote. *after: the index past the closing quote.
  Status SingleQuoted(std::string_view s, size_t v, std::string* out, size_t* after) const {
    for (size_t k = v + 1; k < s.size(); ++k) {
      if (s[k] != '\'') {
        *out += s[k];
      } else if (k + 1 < s.size() && s[k + 1] == '\'') {
        *out += '\'';
        ++k;
      } else {
        *after = k + 1;
        return OkStatus();
      }
    }
    return Unsupported(v, "the closing ' is missing on this line; a quoted value must end on "
                          "the line it starts (write '' for a quote inside it)");
  }

  // "text" at s[v] with YAML's escapes. *after: the index past the closing quote.
  Status DoubleQuoted(std::string_view s, size_t v, std::string* out, size_t* after) const {
    for (size_t k = v + 1; k < s.size(); ++k) {
      if (s[k] == '"') {
        *after = k + 1;
        return OkStatus();
      }
      if (s[k] != '\\') {
        *out += s[k];
        continue;
      }
      const size_t at = k;
      if (++k == s.size()) {
        return Unsupported(at, "a '\\' at the end of the line continues a quoted value on the "
                               "next one, which config files do not support; write it on one "
                               "line (\\n for a line break)");
      }
      int hex_digits = 0;
      switch (s[k]) {
        case '0': return NulEscape(at);
        case 'a': *out += '\a'; break;
        case 'b': *out += '\b'; break;
        case 't': case '\t': *out += '\t'; break;
        case 'n': *out += '\n'; break;
        case 'v': *out += '\v'; break;
        case 'f': *out += '\f'; break;
        case 'r': *out += '\r'; break;
        case 'e': *out += '\x1b'; break;
        case ' ': *out += ' '; break;
        case '"': *out += '"'; break;
        case '/': *out += '/'; break;
        case '\\': *out += '\\'; break;
        case 'N': AppendUtf8(0x85, out); break;
        case '_': AppendUtf8(0xA0, out); break;
        case 'L': AppendUtf8(0x2028, out); break;
        case 'P': AppendUtf8(0x2029, out); break;
        case 'x': hex_digits = 2; break;
        case 'u': hex_digits = 4; break;
        case 'U': hex_digits = 8; break;
        default: {
          // The escaped character, whole (it may be several UTF-8 bytes).
          size_t len = 1;
          while (k + len < s.size() && (static_cast<unsigned char>(s[k + len]) & 0xC0) == 0x80) ++len;
          return Unsupported(at, "unknown escape '\\" + std::string(s.substr(k, len)) +
                                     "' in a double-quoted value; write \\\\ for a backslash, "
                                     "or use single quotes, where \\ is an ordinary character "
                                     "(known escapes: \\\" \\\\ \\/ \\n \\t \\r \\xXX \\uXXXX "
                                     "\\UXXXXXXXX and YAML's others)");
        }
      }
      if (hex_digits == 0) continue;
      uint32_t cp = 0;
      for (int d = 0; d < hex_digits; ++d) {
        const size_t h = k + 1 + d;
        const char ch = h < s.size() ? s[h] : '\0';
        int digit;
        if (ch >= '0' && ch <= '9') {
          digit = ch - '0';
        } else if (ch >= 'a' && ch <= 'f') {
          digit = ch - 'a' + 10;
        } else if (ch >= 'A' && ch <= 'F') {
          digit = ch - 'A' + 10;
        } else {
          return Unsupported(at, "the escape '\\" + std::string(1, s[k]) + "' needs " +
                                     std::to_string(hex_digits) + " hex digits");
        }
        cp = cp * 16 + static_cast<uint32_t>(digit);
      }
      k += hex_digits;
      if (cp == 0) return NulEscape(at);
      if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
        return Unsupported(at, "the escape '\\" + std::string(s.substr(at + 1, hex_digits + 1)) +
                                   "' is not a Unicode character (a surrogate, or past "
                                   "U+10FFFF)");
      }
      AppendUtf8(cp, out);
    }
    return Unsupported(v, "the closing \" is missing on this line; a quoted value must end on "
                          "the line it starts (write \\\" for a quote inside it)");
  }

  // A tab in s[from, to): outside quotes and comments, tabs are refused.
  // YAML 1.2 takes them as separating spaces, YAML 1.1 readers (PyYAML)
  // refuse most of them, and an editor may show them as any width.
  Status NoTab(std::string_view s, size_t from, size_t to) const {
    const size_t tab = s.substr(0, to).find('\t', from);
    if (tab == std::string_view::npos) return OkStatus();
    return Unsupported(tab, "a tab outside quotes (YAML readers disagree on tabs); use spaces, "
                            "or write the tab as \\t inside double quotes");
  }

  Status NulEscape(size_t at) const {
    return Unsupported(at, "a NUL character (\\0) in a value is not allowed; remove it");
  }

  // `key:` then an indented line or a `- ` line: a nested value of that key.
  Status Nested(Kind kind) {
    entries_.back().kind = kind;
    stop_ = true;
    return OkStatus();
  }

  Status TopLevel(size_t i) const {
    if (entries_.empty()) {
      return InvalidArgument("config file " + Where(i) +
                             ": the top level must be a mapping of key: value lines");
    }
    return Malformed(i, "a sequence outside a key; config files are flat key: value lines");
  }

  const std::string_view text_;
  const std::string_view source_;
  std::vector<FlatYamlEntry> entries_;
  int64_t line_ = 0;        // 1-based, of the line being read
  size_t line_start_ = 0;   // its first byte in text_
  bool started_ = false;    // a '---' was read
  bool ended_ = false;      // a '...' was read
  bool open_key_ = false;   // the last content line was `key:` with nothing after
  bool stop_ = false;       // a nested value was found; the rest is not read
};

}  // namespace

Result<std::vector<FlatYamlEntry>> ParseFlatYaml(std::string_view text, std::string_view source) {
  return FlatYamlReader(text, source).Read();
}

}  // namespace fp8moe
