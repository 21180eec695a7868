// Quantizes a small weight and reads back a safetensors file through the
// installed library; exits non-zero if anything disagrees.
#include <cmath>
#include <cstdio>
#include <vector>

#include "fp8moe/numerics.h"
#include "fp8moe/quant.h"
#include "fp8moe/safetensors.h"

int main() {
  using namespace fp8moe;
  if (EncodeFp8(464.0f, Fp8Format::kE4M3FN, false) != 0x7E) return 1;
  std::vector<float> w = {0.5f, -1.0f, 2.0f, 448.0f, -3.0f, 0.25f};
  std::vector<uint8_t> q(w.size());
  std::vector<float> scales(3);
  if (!QuantizeChannels(w.data(), 1, 2, 3, QuantDType::kE4M3FN,
                        Calibration::AbsMax(), q.data(), scales.data()).ok()) {
    return 2;
  }
  auto t = Tensor::Create(DType::kE4M3FN, {2, 3});
  if (!t.ok()) return 3;
  for (int i = 0; i < 6; ++i) t->data_as<uint8_t>()[i] = q[i];
  SafetensorsFile f;
  if (!f.Add("w", std::move(t).value()).ok()) return 4;
  if (!WriteSafetensors("consumer_test.safetensors", f).ok()) return 5;
  auto back = ReadSafetensors("consumer_test.safetensors");
  if (!back.ok() || back->Find("w") == nullptr) return 6;
  for (int i = 0; i < 6; ++i) {
    const float v = DequantizeValue(back->Find("w")->data_as<uint8_t>()[i],
                                    scales[i % 3], QuantDType::kE4M3FN);
    if (std::fabs(v - w[i]) > std::fabs(w[i]) * 0.0625f) return 7;
  }
  std::printf("consumer: fp8moe found, quantized, wrote and read back OK (%s)\n",
              SimdTargetName());
  return 0;
}
