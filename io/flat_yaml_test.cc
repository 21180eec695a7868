#include "io/flat_yaml.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace fp8moe {
namespace {

using Kind = FlatYamlEntry::Kind;

// The entries of `text` as "key=value" ("key=~" for null, "key=[..]" and
// "key={..}" for nested), or "error: message".
std::vector<std::string> Parse(const std::string& text) {
  Result<std::vector<FlatYamlEntry>> r = ParseFlatYaml(text, "f.yml");
  if (!r.ok()) return {"error: " + r.status().message()};
  std::vector<std::string> out;
  for (const FlatYamlEntry& e : *r) {
    switch (e.kind) {
      case Kind::kScalar:
        out.push_back(e.key + "=" + e.value);
        break;
      case Kind::kNull:
        out.push_back(e.key + "=~");
        break;
      case Kind::kNestedMapping:
        out.push_back(e.key + "={..}");
        break;
      case Kind::kNestedSequence:
        out.push_back(e.key + "=[..]");
        break;
    }
  }
  return out;
}

// The one value of a one-line file "k: <value>\n".
std::string Value(const std::string& value) {
  const std::vector<std::string> entries = Parse("k: " + value + "\n");
  if (entries.size() != 1) return "<" + std::to_string(entries.size()) + " entries>";
  const std::string& e = entries[0];
  return e.rfind("k=", 0) == 0 ? e.substr(2) : e;
}

// The error message of `text`, or "" if it parsed.
std::string Error(const std::string& text) {
  Result<std::vector<FlatYamlEntry>> r = ParseFlatYaml(text, "f.yml");
  return r.ok() ? "" : r.status().message();
}

#define EXPECT_ERROR(text, part)                                            \
  do {                                                                      \
    const std::string message_ = Error(text);                               \
    EXPECT_NE(message_, "") << "accepted: " << (text);                      \
    EXPECT_NE(message_.find(part), std::string::npos)                       \
        << "input: " << (text) << "\n  message: " << message_ << "\n  part: " << (part); \
  } while (0)

using V = std::vector<std::string>;

TEST(FlatYaml, LinesCommentsAndMarkers) {
  EXPECT_EQ(Parse(""), V{});
  EXPECT_EQ(Parse("\n\n  \n"), V{});
  EXPECT_EQ(Parse("# only\n  # indented comment\n"), V{});
  EXPECT_EQ(Parse("---\n"), V{});
  EXPECT_EQ(Parse("--- # a comment\na: 1\n...\n# after\n"), V({"a=1"}));
  EXPECT_EQ(Parse("# c\n---\na: 1\nb: two # c\n\n  # c\nc: 3"), V({"a=1", "b=two", "c=3"}));
  EXPECT_EQ(Parse("a: 1\r\nb: 2\r\n"), V({"a=1", "b=2"}));          // CRLF
  EXPECT_EQ(Parse("\xEF\xBB\xBF" "a: 1\n"), V({"a=1"}));             // BOM
  EXPECT_EQ(Parse("a : x\n"), V({"a=x"}));                           // space before ':'
  EXPECT_EQ(Parse("a: 1\na: 2\n"), V({"a=1", "a=2"}));               // duplicates are kept
  EXPECT_EQ(Parse("x.y/z-w_1: v\n"), V({"x.y/z-w_1=v"}));
  EXPECT_EQ(Parse("a:b: c\n"), V({"a:b=c"}));  // the first ': ' ends the key
  EXPECT_EQ(Parse("-x: 1\n?y: 2\n"), V({"-x=1", "?y=2"}));
}

TEST(FlatYaml, PlainScalarsAsYamlReadsThem) {
  EXPECT_EQ(Value("fp8"), "fp8");
  EXPECT_EQ(Value("3e-4   "), "3e-4");         // trailing spaces dropped
  EXPECT_EQ(Value("a # b"), "a");              // a comment
  EXPECT_EQ(Value("a#b"), "a#b");              // not a comment
  EXPECT_EQ(Value("a  b   c"), "a  b   c");    // inner spaces kept
  EXPECT_EQ(Value("a:b"), "a:b");
  EXPECT_EQ(Value("http://x.y/z"), "http://x.y/z");
  EXPECT_EQ(Value("a, b]"), "a, b]");          // flow indicators inside block text
  EXPECT_EQ(Value("a&b*c !d |e"), "a&b*c !d |e");
  EXPECT_EQ(Value("-1"), "-1");
  EXPECT_EQ(Value("+0.5"), "+0.5");
  EXPECT_EQ(Value(".inf"), ".inf");            // typing is Config::Set's job
  EXPECT_EQ(Value("yes"), "yes");
  EXPECT_EQ(Value("?x"), "?x");
  EXPECT_EQ(Value(":x"), ":x");
  EXPECT_EQ(Value("r\xc3\xa9sum\xc3\xa9"), "r\xc3\xa9sum\xc3\xa9");
}

TEST(FlatYaml, NullForms) {
  EXPECT_EQ(Parse("a:\nb:   # c\nc: ~\nd: null\ne: Null\nf: NULL\n"),
            V({"a=~", "b=~", "c=~", "d=~", "e=~", "f=~"}));
  EXPECT_EQ(Value("nULL"), "nULL");
  EXPECT_EQ(Value("~x"), "~x");
  EXPECT_EQ(Value("\"null\""), "null");
  EXPECT_EQ(Value("'~'"), "~");
  EXPECT_EQ(Parse("a:"), V({"a=~"}));  // no final line break
}

TEST(FlatYaml, SingleQuoted) {
  EXPECT_EQ(Value("''"), "");
  EXPECT_EQ(Value("'from file'"), "from file");
  EXPECT_EQ(Value("'it''s'"), "it's");
  EXPECT_EQ(Value("''''"), "'");
  EXPECT_EQ(Value("'a # b'  # c"), "a # b");
  EXPECT_EQ(Value("'a\\nb'"), "a\\nb");  // no escapes in single quotes
  EXPECT_EQ(Value("' padded  '"), " padded  ");
  EXPECT_EQ(Value("'*x: &y [z]'"), "*x: &y [z]");
}

TEST(FlatYaml, DoubleQuoted) {
  EXPECT_EQ(Value("\"\""), "");
  EXPECT_EQ(Value("\"a\\\"b\\\\c\\/d\""), "a\"b\\c/d");
  EXPECT_EQ(Value("\"\\n\\t\\r\\a\\b\\v\\f\\e\\ \""),
            std::string("\n\t\r\a\b\v\f\x1b "));
  EXPECT_EQ(Value("\"\\x01\\x7F\\u00e9\\u20AC\\U0001F600\""),
            "\x01\x7f\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
  EXPECT_EQ(Value("\"\\N\\_\\L\\P\""), "\xc2\x85\xc2\xa0\xe2\x80\xa8\xe2\x80\xa9");
  EXPECT_EQ(Value("\"it's #not a comment\" # a comment"), "it's #not a comment");
  EXPECT_EQ(Value("\"tab\there\""), "tab\there");
  EXPECT_EQ(Value("\"a\\\tb\""), "a\tb");  // backslash-tab
}

TEST(FlatYaml, NestedValuesAreReportedNotRead) {
  EXPECT_EQ(Parse("a: [1, 2]\nb: 3\n"), V({"a=[..]"}));  // stops at the nested value
  EXPECT_EQ(Parse("a: {x: 1}\n"), V({"a={..}"}));
  EXPECT_EQ(Parse("a: 1\nb:\n  x: 1\n  y: 2\n"), V({"a=1", "b={..}"}));
  EXPECT_EQ(Parse("b:\n  # comment\n\n  - 1\n"), V({"b=[..]"}));
  EXPECT_EQ(Parse("b:\n- 1\n- 2\n"), V({"b=[..]"}));
  EXPECT_EQ(Parse("b:\n  -\n"), V({"b=[..]"}));
  EXPECT_EQ(Parse("b:\n  [1]\n"), V({"b=[..]"}));
  EXPECT_EQ(Parse("b:\n  {x: 1}\n"), V({"b={..}"}));
  EXPECT_EQ(Parse("b:\n  x:\n"), V({"b={..}"}));
  EXPECT_EQ(Parse("b:\n  ? x\n"), V({"b={..}"}));
  // Unclosed or deep flow collections are still "nested", read no further.
  EXPECT_EQ(Parse("a: [[[[" + std::string(100000, '[') + "\n"), V({"a=[..]"}));
}

TEST(FlatYaml, RefusedFormsNameLineColumnAndFix) {
  // Anchors, aliases, tags, block scalars and reserved indicators.
  EXPECT_ERROR("a: &x 1\n", "f.yml line 1, column 4: the value of 'a' starts with '&', an anchor");
  EXPECT_ERROR("a: 1\nb: *x\n", "f.yml line 2, column 4: the value of 'b' starts with '*', an alias");
  EXPECT_ERROR("a: !!str 1\n", "a tag (!name, !!str); tags are not supported; to mean the text "
                               "itself, quote it: a: '!!str 1'");
  // The suggested fix gives the text as written: single quotes (a ' doubled,
  // a backslash kept), the comment left out.
  EXPECT_ERROR("run_name: @C:\\tmp # where\n", "quote it: run_name: '@C:\\tmp'");
  EXPECT_ERROR("a: &x it's # note\n", "quote it: a: '&x it''s'");
  EXPECT_ERROR("run_name: a: b\n", "quote it: run_name: 'a: b'");
  EXPECT_ERROR("a: |\n  text\n", "line 1, column 4: the value of 'a' starts with '|', a block scalar");
  EXPECT_ERROR("a: >-\n  text\n", "a block scalar");
  EXPECT_ERROR("a: %x\n", "starts with '%'");
  EXPECT_ERROR("a: @x\n", "starts with '@'");
  EXPECT_ERROR("a: `x\n", "starts with '`'");
  EXPECT_ERROR("a: ,x\n", "starts with ','");
  EXPECT_ERROR("a: ]\n", "starts with ']'");
  EXPECT_ERROR("a: ? x\n", "starts with '?', a mapping indicator");
  EXPECT_ERROR("&a b: 1\n", "line 1, column 1: '&' at the start of a line is an anchor");
  EXPECT_ERROR("*a: 1\n", "an alias");
  EXPECT_ERROR("!t a: 1\n", "a tag");
  EXPECT_ERROR(",teps: 0\n", "line 1, column 1: ',' at the start of a line");
  EXPECT_ERROR("&m_exp,", "an anchor");
  EXPECT_ERROR("? a\n: 1\n", "a complex key");
  EXPECT_ERROR(": 1\n", "a key is missing before ':'");
  EXPECT_ERROR("%YAML 1.2\n---\na: 1\n", "line 1, column 1: directives (%YAML, %TAG) are not supported");
  EXPECT_ERROR("\"a\": 1\n", "a quoted key");
  EXPECT_ERROR("'a': 1\n", "a quoted key");
  EXPECT_ERROR("{a: 1}\n", "a flow mapping { }");
  // Values over several lines.
  EXPECT_ERROR("a: 1\nb: x\n  y\n", "malformed YAML in f.yml line 3, column 3: an indented line after 'b' (line 2)");
  EXPECT_ERROR("a: 1\nb:\n  text\n", "f.yml line 3, column 3: the value of 'b' (line 2) is on the next line");
  EXPECT_ERROR("a: 1\nb: x\ny\n", "malformed YAML in f.yml line 3, column 1: 'y' is not a key: value line");
  EXPECT_ERROR("a: \"x\n  y\"\n", "line 1, column 4: the closing \" is missing on this line");
  EXPECT_ERROR("a: 'x\n  y'\n", "line 1, column 4: the closing ' is missing");
  EXPECT_ERROR("a: \"x\\\n  y\"\n", "a '\\' at the end of the line");
  // Tabs as indentation; indented keys.
  EXPECT_ERROR("a:\n\tb: 1\n", "line 2, column 1: a tab used for indentation");
  EXPECT_ERROR("a: 1\n  \tb: 1\n", "line 2, column 3: a tab used for indentation");
  EXPECT_ERROR("  a: 1\n", "line 1, column 3: an indented key; start every key at column 1");
  // Several documents.
  EXPECT_ERROR("a: 1\n---\na: 2\n", "f.yml line 2, column 1: a second YAML document starts here");
  EXPECT_ERROR("---\n---\n", "line 2, column 1: a second YAML document");
  EXPECT_ERROR("a: 1\n...\nb: 2\n", "line 3, column 1: a second YAML document");
  EXPECT_ERROR("--- a: 1\n", "content on the '---' line");
  EXPECT_ERROR("... x\n", "content on the '...' line");
  // Not a mapping.
  EXPECT_ERROR("- a\n", "f.yml line 1, column 1: the top level must be a mapping");
  EXPECT_ERROR("[a, b]\n", "the top level must be a mapping");
  EXPECT_ERROR("# c\nnum_experts\n", "line 2, column 1: the top level must be a mapping of key: value lines; 'num_experts' is not");
  EXPECT_ERROR("a:1\n", "'a:1' is not a key: value line (put a space after the ':')");
  EXPECT_ERROR("a: 1\n- b\n", "line 2, column 1: a sequence outside a key");
  EXPECT_ERROR("a: - b\n", "line 1, column 4: a list item ('- ') as the value of 'a'");
  // Tabs outside quotes (YAML 1.1 readers refuse them); inside quotes and
  // comments they are fine.
  EXPECT_ERROR("a:\tx\n", "line 1, column 3: a tab outside quotes");
  EXPECT_ERROR("a: 3e-4 \t\n", "line 1, column 9: a tab outside quotes");
  EXPECT_ERROR("a: x\t# c\n", "line 1, column 5: a tab outside quotes");
  EXPECT_ERROR("a: x\ty\n", "line 1, column 5: a tab outside quotes");
  EXPECT_ERROR("a\t: x\n", "line 1, column 2: a tab outside quotes");
  EXPECT_ERROR("a: 'x'\t# c\n", "line 1, column 7: a tab outside quotes");
  EXPECT_ERROR("a:\t# c\n", "a tab outside quotes");
  EXPECT_ERROR("a: 1\n\t\n", "line 2, column 1: a tab on a blank or comment line");
  EXPECT_ERROR("a: 1\n  \t# c\n", "line 2, column 3: a tab on a blank or comment line");
  EXPECT_ERROR("---\t\n", "line 1, column 4: a tab outside quotes");
  EXPECT_ERROR("a: 1\n...\t# c\n", "line 2, column 4: a tab outside quotes");
  EXPECT_EQ(Parse("a: 'x\ty' # c\tc\n# \t\n"), V({"a=x\ty"}));
  // Keys and values that YAML reads otherwise.
  EXPECT_ERROR("a b: 1\n", "line 1, column 2: the key 'a b' holds a space");
  EXPECT_ERROR("a: b: c\n", "malformed YAML in f.yml line 1, column 5: ': ' inside the value of 'a'");
  EXPECT_ERROR("a: b:\n", "': ' inside the value of 'a'");
  EXPECT_ERROR("a: \"x\"y\n", "line 1, column 7: text after the closing quote");
  EXPECT_ERROR("a: 'x'#c\n", "a comment needs a space before its '#'");
  // Escapes.
  EXPECT_ERROR("a: \"\\q\"\n", "line 1, column 5: unknown escape '\\q' in a double-quoted value; write \\\\ for a backslash");
  EXPECT_ERROR("a: \"\\\xc3\xa9\"\n", "unknown escape '\\\xc3\xa9'");
  EXPECT_ERROR("a: \"\\x4\"\n", "the escape '\\x' needs 2 hex digits");
  EXPECT_ERROR("a: \"\\u12\"\n", "the escape '\\u' needs 4 hex digits");
  EXPECT_ERROR("a: \"\\uD800\"\n", "the escape '\\uD800' is not a Unicode character");
  EXPECT_ERROR("a: \"\\U00110000\"\n", "is not a Unicode character");
  EXPECT_ERROR("a: \"\\0\"\n", "a NUL character");
  EXPECT_ERROR("a: \"\\x00\"\n", "a NUL character");
  // Line breaks YAML 1.1 knows and this reader does not.
  EXPECT_ERROR("a: x\ry\n", "line 1, column 5: a carriage return that does not end the line");
  EXPECT_ERROR("a: x\xc2\x85y\n", "line 1, column 5: a Unicode line separator");
  EXPECT_ERROR("a: x\xe2\x80\xa8y\n", "a Unicode line separator");
  // Malformed UTF-8 and characters YAML does not allow: offset, line, column.
  EXPECT_ERROR("a: 1\nb: \xc3\xa9\xff\n",
               "is not valid UTF-8 or holds a character YAML does not allow: byte 0xFF at "
               "offset 10 (line 2, column 5)");
  EXPECT_ERROR(std::string("a: \0\n", 5), "byte 0x00 at offset 3 (line 1, column 4)");
}

TEST(FlatYaml, ColumnsCountCharactersAfterTheLineStart) {
  // Two-byte and three-byte characters count as one column each; the byte
  // order mark does not count.
  EXPECT_ERROR("\xEF\xBB\xBF" "a: b: c\n", "line 1, column 5:");
  EXPECT_ERROR("x: 1\n\xc3\xa9\xe2\x82\xac: b: c\n", "line 2, column 6:");
  EXPECT_ERROR("x: 1\r\ny: \"\\q\"\r\n", "line 2, column 5:");
}

TEST(FlatYaml, LongMessagesAreCut) {
  const std::string message = Error(std::string(10000, 'x') + "\n");
  EXPECT_NE(message.find("'" + std::string(60, 'x') + "...' is not a key: value line"),
            std::string::npos)
      << message.substr(0, 300);
  EXPECT_LT(message.size(), 300u);
}

// The inputs yaml-cpp 0.7 never returned on (config_fuzz found them; they
// are in io/config_fuzz_corpus too), and large versions of every form, are
// answered promptly: the reader is one pass over the bytes.
TEST(FlatYaml, HistoricHangsAndLargeInputsAnswerPromptly) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ERROR(std::string(",ed_buffer_factor: \xff.inf\n"), "byte 0xFF at offset 19");
  EXPECT_ERROR(std::string("&m_exp,\0\0experts: *x\n", 21), "byte 0x00 at offset 7");
  EXPECT_ERROR("&m_exp,", "an anchor");
  EXPECT_ERROR(",teps: 0\n", "',' at the start of a line");
  std::string many;
  for (int i = 0; i < 200000; ++i) many += "k" + std::to_string(i) + ": 'v''" + std::to_string(i) + "' # c\n";
  Result<std::vector<FlatYamlEntry>> r = ParseFlatYaml(many, "many.yml");
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->size(), 200000u);
  EXPECT_EQ((*r)[199999].value, "v'199999");
  EXPECT_EQ((*r)[199999].line, 200000);
  EXPECT_ERROR("k: \"" + std::string(1 << 20, '\\'), "the closing \" is missing");
  EXPECT_ERROR("k: " + std::string(1 << 20, ':') + " \n", "': ' inside the value");
  EXPECT_EQ(Parse(std::string(1 << 20, '\n') + "k: 1").size(), 1u);
  EXPECT_ERROR("k: 1\n" + std::string(1 << 20, ' ') + "x", "an indented line");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Generous: about 0.3 s on the CI machine under ASan; a hang never ends.
  EXPECT_LT(seconds, 30.0);
}

}  // namespace
}  // namespace fp8moe
