// Numbers as the text messages and files show them: the shortest decimal of
// a double, and a 64-bit checksum or fingerprint in hex.
#ifndef FP8MOE_BASE_NUMBER_TEXT_H_
#define FP8MOE_BASE_NUMBER_TEXT_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace fp8moe::internal {

// The shortest decimal text of a double that reads back to the same value,
// in printf's %g form ("0.0005", "1e+04", "0.3333333333333333"): the text a
// message or a `key=value` override shows for a float flag. (io/config.cc's
// to_chars form differs: "5e-04"; messages keep this one.) NaN and
// infinities give "nan", "-inf", "inf" (no precision reads them back).
inline std::string ShortestDecimal(double v) {
  char buf[32];
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof buf, "%.*g", p, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// The same for a float read back with strtof: 0.1f is "0.1" (its double,
// ShortestDecimal's, "0.10000000149011612"). A calibration flag's numbers.
inline std::string ShortestFloatDecimal(float v) {
  char buf[32];
  for (int p = 1; p <= 9; ++p) {
    std::snprintf(buf, sizeof buf, "%.*g", p, static_cast<double>(v));
    if (std::strtof(buf, nullptr) == v) break;
  }
  return buf;
}

// v as 16 lower-case hex digits, "00000000deadbeef": checkpoint checksums
// and config fingerprints.
inline std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace fp8moe::internal

#endif  // FP8MOE_BASE_NUMBER_TEXT_H_
