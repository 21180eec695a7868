#include "kernels/reference/ops_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fp8moe/numerics.h"

namespace fp8moe::internal {

void ReferenceOps::EmbeddingGather(Context&, const EmbeddingGatherArgs& a) {
  for (int64_t i = 0; i < a.n; ++i) {
    for (int64_t c = 0; c < a.d; ++c) a.out[i * a.d + c] = a.table[a.tokens[i] * a.d + c];
  }
}

void ReferenceOps::EmbeddingScatterAdd(Context&, const EmbeddingScatterAddArgs& a) {
  for (int64_t j = 0; j < a.vocab * a.d; ++j) a.dtable[j] = 0.0f;
  for (int64_t i = 0; i < a.n; ++i) {
    for (int64_t c = 0; c < a.d; ++c) a.dtable[a.tokens[i] * a.d + c] += a.dout[i * a.d + c];
  }
}

void ReferenceOps::Add(Context&, const AddArgs& a) {
  for (int64_t i = 0; i < a.n; ++i) a.out[i] = a.a[i] + a.b[i];
}

void ReferenceOps::RmsNormForward(Context&, const RmsNormForwardArgs& a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < a.d; ++i) {
      const double x = a.x[r * a.d + i];
      ss += x * x;
    }
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(a.d) +
                                                         static_cast<double>(a.eps)));
    a.inv_rms[r] = inv;
    for (int64_t i = 0; i < a.d; ++i) a.y[r * a.d + i] = a.x[r * a.d + i] * inv * a.g[i];
  }
}

void ReferenceOps::RmsNormBackward(Context&, const RmsNormBackwardArgs& a) {
  // y = g * xhat, xhat = x * inv: dx = inv * (g dy - xhat * mean(g dy xhat)),
  // dg = sum over rows of dy * xhat.
  for (int64_t r = 0; r < a.rows; ++r) {
    const double inv = a.inv_rms[r];
    double dot = 0;
    for (int64_t i = 0; i < a.d; ++i) {
      const int64_t j = r * a.d + i;
      dot += static_cast<double>(a.g[i]) * a.dy[j] * a.x[j] * inv;
    }
    const double mean = dot / static_cast<double>(a.d);
    for (int64_t i = 0; i < a.d; ++i) {
      const int64_t j = r * a.d + i;
      a.dx[j] += static_cast<float>(inv * (static_cast<double>(a.g[i]) * a.dy[j] -
                                           a.x[j] * inv * mean));
    }
  }
  for (int64_t i = 0; i < a.d; ++i) {
    double s = 0;
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t j = r * a.d + i;
      s += static_cast<double>(a.dy[j]) * a.x[j] * a.inv_rms[r];
    }
    a.dg[i] = static_cast<float>(s);
  }
}

void ReferenceOps::Rope(Context&, const RopeArgs& a) {
  // The q heads and then the k heads: the first heads + kv_heads heads of a
  // row; v is not rotated. Of each head the last rope_dim columns rotate.
  const int64_t half = a.rope_dim / 2, width = (a.heads + a.kv_heads) * a.hd + a.kv_heads * a.vd;
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t p = 0; p < a.seq; ++p) {
      for (int64_t h = 0; h < a.heads + a.kv_heads; ++h) {
        float* v = a.qkv + (b * a.seq + p) * width + h * a.hd + (a.hd - a.rope_dim);
        for (int64_t i = 0; i < half; ++i) {
          const float c = a.cos[p * half + i];
          const float s = a.inverse ? -a.sin[p * half + i] : a.sin[p * half + i];
          float& x0 = v[a.interleaved ? 2 * i : i];
          float& x1 = v[a.interleaved ? 2 * i + 1 : i + half];
          const float y0 = x0 * c - x1 * s, y1 = x1 * c + x0 * s;
          x0 = y0;
          x1 = y1;
        }
      }
    }
  }
}

void ReferenceOps::CopyColumns(Context&, const CopyColumnsArgs& a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t b = 0; b < a.blocks; ++b) {
      for (int64_t j = 0; j < a.width; ++j) {
        const float v = a.src[r * a.src_cols + a.src_offset + b * a.src_step + j];
        float& d = a.dst[r * a.dst_cols + a.dst_offset + b * a.dst_step + j];
        d = a.accumulate ? d + v : v;
      }
    }
  }
}

namespace {

// The heads of one attention call: query head h reads kv head h / group.
// The value heads are vd wide, after the q and k heads of hd.
struct Heads {
  int64_t q, kv, hd, vd;
  int64_t width() const { return (q + kv) * hd + kv * vd; }
  int64_t group() const { return q / kv; }
  // Column of query head h (part 0), or of the key (1) or value (2) head
  // that query head h reads.
  int64_t Column(int64_t part, int64_t h) const {
    if (part == 0) return h * hd;
    return part == 1 ? (q + h / group()) * hd : (q + kv) * hd + h / group() * vd;
  }
};

// Element t of query head h (part 0), or of the key (1) or value (2) head
// that query head h reads, at row `row` of qkv.
double Qkv(const float* qkv, const Heads& n, int64_t row, int64_t part, int64_t h, int64_t t) {
  return qkv[row * n.width() + n.Column(part, h) + t];
}

}  // namespace

void ReferenceOps::AttentionForward(Context&, const AttentionForwardArgs& a) {
  const int64_t S = a.seq, H = a.heads, hd = a.hd, vd = a.vd;
  const Heads n{H, a.kv_heads, hd, vd};
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> p(static_cast<size_t>(S));
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < S; ++i) {
        // Softmax over keys j <= i of scale * q_i . k_j, in double.
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (int64_t t = 0; t < hd; ++t) {
            s += Qkv(a.qkv, n, b * S + i, 0, h, t) * Qkv(a.qkv, n, b * S + j, 1, h, t);
          }
          p[static_cast<size_t>(j)] = s * scale;
          mx = std::max(mx, s * scale);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx);
          sum += p[static_cast<size_t>(j)];
        }
        float* prow = a.probs + ((b * H + h) * S + i) * S;
        for (int64_t j = 0; j < S; ++j) {
          prow[j] = j <= i ? static_cast<float>(p[static_cast<size_t>(j)] / sum) : 0.0f;
        }
        for (int64_t t = 0; t < vd; ++t) {
          double o = 0;
          for (int64_t j = 0; j <= i; ++j) {
            o += p[static_cast<size_t>(j)] / sum * Qkv(a.qkv, n, b * S + j, 2, h, t);
          }
          a.out[(b * S + i) * H * vd + h * vd + t] = static_cast<float>(o);
        }
      }
    }
  }
}

void ReferenceOps::AttentionBackward(Context&, const AttentionBackwardArgs& a) {
  // With P the forward's probabilities (an input) and dO the output's
  // gradient, per query head: dV_j = sum_i P_ij dO_i; dP_ij = dO_i . V_j;
  // dS_ij = P_ij (dP_ij - sum_j' P_ij' dP_ij') * scale; dQ_i = sum_j dS_ij K_j;
  // dK_j = sum_i dS_ij Q_i. A kv head's dK and dV sum those of its query
  // heads, in head order. Each in double, rounded once.
  const int64_t S = a.seq, H = a.heads, hd = a.hd, vd = a.vd;
  const Heads n{H, a.kv_heads, hd, vd};
  const int64_t width = n.width();
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> ds(static_cast<size_t>(S * S)), dk(static_cast<size_t>(S * hd)),
      dv(static_cast<size_t>(S * vd));
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t g = 0; g < n.kv; ++g) {
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      for (int64_t h = g * n.group(); h < (g + 1) * n.group(); ++h) {
        const float* P = a.probs + (b * H + h) * S * S;
        auto dO = [&](int64_t i, int64_t t) {
          return static_cast<double>(a.dout[(b * S + i) * H * vd + h * vd + t]);
        };
        std::fill(ds.begin(), ds.end(), 0.0);
        for (int64_t i = 0; i < S; ++i) {
          double pdp = 0;
          for (int64_t j = 0; j <= i; ++j) {
            double dp = 0;
            for (int64_t t = 0; t < vd; ++t) dp += dO(i, t) * Qkv(a.qkv, n, b * S + j, 2, h, t);
            ds[static_cast<size_t>(i * S + j)] = dp;
            pdp += P[i * S + j] * dp;
          }
          for (int64_t j = 0; j <= i; ++j) {
            double& d = ds[static_cast<size_t>(i * S + j)];
            d = P[i * S + j] * (d - pdp) * scale;
          }
        }
        for (int64_t r = 0; r < S; ++r) {
          for (int64_t t = 0; t < hd; ++t) {
            double q = 0, k = 0;
            for (int64_t j = 0; j <= r; ++j) {  // row r as a query
              q += ds[static_cast<size_t>(r * S + j)] * Qkv(a.qkv, n, b * S + j, 1, h, t);
            }
            for (int64_t i = r; i < S; ++i) {  // row r as a key
              k += ds[static_cast<size_t>(i * S + r)] * Qkv(a.qkv, n, b * S + i, 0, h, t);
            }
            a.dqkv[(b * S + r) * width + h * hd + t] = static_cast<float>(q);
            dk[static_cast<size_t>(r * hd + t)] += k;
          }
          for (int64_t t = 0; t < vd; ++t) {
            double v = 0;
            for (int64_t i = r; i < S; ++i) v += P[i * S + r] * dO(i, t);  // row r as a value
            dv[static_cast<size_t>(r * vd + t)] += v;
          }
        }
      }
      for (int64_t r = 0; r < S; ++r) {
        float* row = a.dqkv + (b * S + r) * width;
        for (int64_t t = 0; t < hd; ++t) {
          row[(H + g) * hd + t] = static_cast<float>(dk[static_cast<size_t>(r * hd + t)]);
        }
        for (int64_t t = 0; t < vd; ++t) {
          const double v = dv[static_cast<size_t>(r * vd + t)];
          row[(H + n.kv) * hd + g * vd + t] = static_cast<float>(v);
        }
      }
    }
  }
}

void ReferenceOps::CrossEntropy(Context&, const CrossEntropyArgs& a) {
  // loss_r = log(sum_i exp(l_i - m)) + m - l_target, in double;
  // dlogits = (softmax - onehot) / rows.
  double total = 0;
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* l = a.logits + r * a.v;
    double m = l[0];
    for (int64_t i = 1; i < a.v; ++i) m = std::max(m, static_cast<double>(l[i]));
    double sum = 0;
    for (int64_t i = 0; i < a.v; ++i) sum += std::exp(static_cast<double>(l[i]) - m);
    total += std::log(sum) + m - static_cast<double>(l[a.targets[r]]);
    if (a.dlogits != nullptr) {
      for (int64_t i = 0; i < a.v; ++i) {
        const double p = std::exp(static_cast<double>(l[i]) - m) / sum;
        a.dlogits[r * a.v + i] =
            static_cast<float>((p - (i == a.targets[r] ? 1.0 : 0.0)) / static_cast<double>(a.rows));
      }
    }
  }
  *a.loss = a.rows > 0 ? total / static_cast<double>(a.rows) : 0.0;
}

void ReferenceOps::AdamW(Context&, const AdamWArgs& a) {
  const AdamWConstants& k = a.k;
  for (int64_t i = 0; i < a.n; ++i) {
    const float g = a.g[i] * k.grad_scale;
    a.m[i] = k.b1 * a.m[i] + (1.0f - k.b1) * g;
    a.v[i] = k.b2 * a.v[i] + (1.0f - k.b2) * g * g;
    const float step = (a.m[i] * k.c1) / (std::sqrt(a.v[i] * k.c2) + k.eps);
    a.p[i] -= k.lr * (step + k.weight_decay * a.p[i]);
  }
}

// ---- Quantization (quant/ is the cpu implementation's code) ----

namespace {

// max |x| over x[first + i * stride], i < n; NaN if one is NaN; 0 if n = 0.
float AbsMaxOf(const float* x, int64_t first, int64_t n, int64_t stride) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[first + i * stride];
    nan = nan || std::isnan(v);
    if (std::fabs(v) > amax) amax = std::fabs(v);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

// The scale of a scaling group with elements x[first + i * stride], i < n.
float GroupScaleOf(const float* x, int64_t first, int64_t n, int64_t stride, QuantDType dtype,
                   const Calibration& calib) {
  const bool absmax = calib.kind == Calibration::Kind::kAbsMax;
  return CalibratedScale(absmax ? AbsMaxOf(x, first, n, stride) : 0.0f, dtype, calib);
}

}  // namespace

void ReferenceOps::QuantizeRows(Context&, const QuantizeRowsArgs& a) {
  const int64_t blocks = NumBlocks(a.cols, a.block_size);
  const int64_t width = a.block_size > 0 ? a.block_size : a.cols;
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * width, c1 = std::min(a.cols, c0 + width);
      const bool tail = r >= a.valid_rows;
      const float s =
          tail ? 0.0f : GroupScaleOf(a.x, r * a.cols + c0, c1 - c0, 1, a.dtype, a.calib);
      a.scales[r * blocks + b] = s;
      for (int64_t c = c0; c < c1; ++c) {
        a.q[r * a.cols + c] =
            tail ? 0 : QuantizeValue(a.x[r * a.cols + c], s, a.dtype, a.calib.arithmetic);
      }
    }
  }
}

void ReferenceOps::DequantizeRows(Context&, const DequantizeRowsArgs& a) {
  const int64_t blocks = NumBlocks(a.cols, a.block_size);
  const int64_t width = a.block_size > 0 ? a.block_size : a.cols;
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t c = 0; c < a.cols; ++c) {
      const float s = a.scales[r * blocks + c / width];
      a.x[r * a.cols + c] = DequantizeValue(a.q[r * a.cols + c], s, a.dtype);
    }
  }
}

void ReferenceOps::QuantizeChannels(Context&, const QuantizeChannelsArgs& a) {
  for (int64_t e = 0; e < a.experts; ++e) {
    for (int64_t j = 0; j < a.n; ++j) {  // channel j of expert e: a column of k
      const int64_t first = e * a.k * a.n + j;
      const float s = GroupScaleOf(a.w, first, a.k, a.n, a.dtype, a.calib);
      a.scales[e * a.n + j] = s;
      for (int64_t i = 0; i < a.k; ++i) {
        a.q[first + i * a.n] = QuantizeValue(a.w[first + i * a.n], s, a.dtype, a.calib.arithmetic);
      }
    }
  }
}

void ReferenceOps::DequantizeChannelsToBf16(Context&, const DequantizeChannelsToBf16Args& a) {
  for (int64_t e = 0; e < a.experts; ++e) {
    for (int64_t i = 0; i < a.k; ++i) {
      for (int64_t j = 0; j < a.n; ++j) {
        const int64_t at = (e * a.k + i) * a.n + j;
        a.out[at] = F32ToBf16(DequantizeValue(a.q[at], a.scales[e * a.n + j], a.dtype));
      }
    }
  }
}

void ReferenceOps::ScaleToF32(Context&, const ScaleToF32Args& a) {
  int64_t r = 0;
  for (int64_t g = 0; g < a.groups; ++g) {
    for (int64_t end = r + a.group_sizes[g]; r < end; ++r) {
      for (int64_t c = 0; c < a.cols; ++c) {
        const int64_t at = r * a.cols + c;
        const float x = a.x_dtype == DType::kF32 ? static_cast<const float*>(a.x)[at]
                                                 : Bf16ToF32(static_cast<const uint16_t*>(a.x)[at]);
        a.out[at] = x * (a.by == ScaleBy::kRow ? a.scale[r] : a.scale[g * a.cols + c]);
      }
    }
  }
}

void ReferenceOps::Fp8HealthCount(Context&, const Fp8HealthCountArgs& a) {
  // saturated: |value| = the format's max; flushed: value 0 from x != 0.
  Fp8CodeCounts counts;
  for (int64_t i = 0; i < a.n; ++i) {
    const float v = DequantizeValue(a.q[i], 1.0f, a.dtype);
    if (std::fabs(v) == QuantMax(a.dtype)) ++counts.saturated;
    if (v == 0.0f && a.x[i] != 0.0f) ++counts.flushed;
  }
  *a.counts = counts;
}

}  // namespace fp8moe::internal
