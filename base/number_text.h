// The shortest decimal text of a double that reads back to the same value,
// in printf's %g form ("0.0005", "1e+04", "0.10000000000000001"): the text a
// message or a `key=value` override shows for a float flag. (io/config.cc's
// to_chars form differs: "5e-04"; messages keep this one.)
#ifndef FP8MOE_BASE_FLOAT_TEXT_H_
#define FP8MOE_BASE_FLOAT_TEXT_H_

#include <cstdio>
#include <cstdlib>
#include <string>

namespace fp8moe::internal {

// NaN and infinities give "nan", "-inf", "inf" (no precision reads them back).
inline std::string ShortestDecimal(double v) {
  char buf[32];
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof buf, "%.*g", p, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

}  // namespace fp8moe::internal

#endif  // FP8MOE_BASE_FLOAT_TEXT_H_
