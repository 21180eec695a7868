// The library version.
#ifndef FP8MOE_VERSION_H_
#define FP8MOE_VERSION_H_

namespace fp8moe {
inline constexpr const char kVersion[] = "0.1.0";
}  // namespace fp8moe

#endif  // FP8MOE_VERSION_H_
