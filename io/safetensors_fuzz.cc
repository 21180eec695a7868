// libFuzzer entry point for the safetensors parser; see io/FUZZING.md.
//
// Any input must parse or fail cleanly (the sanitizers catch crashes, leaks
// and out-of-bounds reads). An input that parses must also survive a round
// trip: serialize, parse again, and get the same tensors and the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fp8moe/safetensors.h"

namespace {

void Fail(const char* what) {
  std::fprintf(stderr, "safetensors_fuzz: %s\n", what);
  std::abort();
}

bool SameFile(const fp8moe::SafetensorsFile& a,
              const fp8moe::SafetensorsFile& b) {
  if (a.tensors.size() != b.tensors.size() || a.metadata != b.metadata) {
    return false;
  }
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [an, at] = a.tensors[i];
    const auto& [bn, bt] = b.tensors[i];
    if (an != bn || at.dtype() != bt.dtype() || at.shape() != bt.shape() ||
        at.num_bytes() != bt.num_bytes() ||
        std::memcmp(at.data(), bt.data(), at.num_bytes()) != 0) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = fp8moe::ParseSafetensors(data, size);
  if (!file.ok()) {
    if (file.status().message().empty()) Fail("error without a message");
    return 0;
  }
  auto bytes = fp8moe::SerializeSafetensors(*file);
  if (!bytes.ok()) Fail("a parsed file does not serialize");
  auto again = fp8moe::ParseSafetensors(bytes->data(), bytes->size());
  if (!again.ok()) Fail("a serialized file does not parse");
  if (!SameFile(*file, *again)) Fail("round trip changed the contents");
  auto bytes2 = fp8moe::SerializeSafetensors(*again);
  if (!bytes2.ok() || *bytes2 != *bytes) Fail("serialization not stable");
  return 0;
}
