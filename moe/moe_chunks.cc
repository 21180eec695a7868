// The MoE layer in token chunks (moe/moe_chunks.h).
//
// Why chunks: on the ring of experts a chunk's dispatch all-gathers its
// tokens and routing over the ring, and its GMMs cannot start before that;
// with C chunks the all-gathers of chunk c + 1 run while chunk c's GMMs do,
// so only the first chunk's gather is exposed (MaxText's
// num_moe_token_chunks, which XLA overlaps by scheduling).
//
// Why the bits hold: top-k, the routing weights, the quantization of a token
// and each GMM row are per token, so a chunk computes each of its rows as
// the whole batch would; the route runs once on all T tokens so the
// load-balancing fractions are the batch's. What changes is the expert
// weight gradient, which sums over rows: here the sum of C per-chunk
// gradients. On a ring of three or more ranks the ring's f32 sums also
// depend on where an element sits in its block (communicator.h), which the
// chunk moves.
#include "moe/moe_chunks.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fp8moe/communicator.h"
#include "kernels/ops.h"
#include "moe/moe_stages.h"
#include "moe/routing.h"

namespace fp8moe::internal {

using State = MoeWorkspace::State;

namespace {

// Rows [r.begin, r.end) of t [T, cols] f32, as a view of t's kind: an
// input's rows read-only (ConstTensorView), an output's read-write.
template <class View>
View Rows(const View& t, const ShardRange& r) {
  const int64_t cols = t.shape[1];
  return View{t.template as<float>() + r.begin * cols, DType::kF32, {r.size(), cols}};
}

ShardRange ChunkRange(const State& s, int64_t c) {
  return GetShardRange(s.T, static_cast<int>(s.chunks.size()), static_cast<int>(c));
}

// Chunk c's state: the layer's shapes and plan, T its tokens, and the
// routing of those tokens (Route on their rows of the logits: per token the
// same experts and weights as the whole batch's routing, sorted within the
// chunk).
Status PrepareChunk(Context& ctx, const MoeConfig& cfg, const State& s, int64_t c, State& cs) {
  const ShardRange r = ChunkRange(s, c);
  cs.T = r.size();
  cs.D = s.D;
  cs.E = s.E;
  cs.k = s.k;
  cs.F = s.F;
  cs.plan = s.plan;
  cs.act = s.act;
  cs.ring = s.ring;
  cs.P = s.P;
  cs.ring_index = s.ring_index;
  return Route(ctx, s.logits.data_as<float>() + r.begin * s.E, cs.T, s.E, s.k,
               ScoringOf(cfg, s.route_bias), &cs.routing);
}

}  // namespace

Status ChunkedForward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                      const ConstTensorView& router, const PreparedMoeWeights& prepared,
                      const MoeOptions& options, State& s, const TensorView& y, MoeStepInfo* info) {
  const int64_t C = cfg.num_moe_token_chunks;
  FP8MOE_RETURN_IF_ERROR(RouteForward(ctx, cfg, x, router, options, s, &info->aux_loss));
  s.chunks.resize(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    auto& cs = s.chunks[static_cast<size_t>(c)];
    if (cs == nullptr) cs = std::make_unique<State>();
    FP8MOE_RETURN_IF_ERROR(PrepareChunk(ctx, cfg, s, c, *cs));
  }
  std::vector<MoeStats> stats(static_cast<size_t>(C));
  auto dispatch = [&](int64_t c) {
    return DispatchForward(ctx, cfg, Rows(x, ChunkRange(s, c)), options,
                           *s.chunks[static_cast<size_t>(c)], &stats[static_cast<size_t>(c)]);
  };
  Status pending = dispatch(0);
  for (int64_t c = 0; c < C; ++c) {
    FP8MOE_RETURN_IF_ERROR(pending);
    State& cs = *s.chunks[static_cast<size_t>(c)];
    const bool next = c + 1 < C;
    // The helper thread only runs the dispatch (collectives, copies, its
    // own OpenMP team); this thread runs the GMMs, which use no
    // collective, so the communicator is used by one thread at a time. The
    // dispatch's op (the gathered tokens' dequantization) reads only ctx's
    // backend and thread count, never the scratch the GMMs use.
    std::thread helper;
    if (next && s.P > 1) helper = std::thread([&, c] { pending = dispatch(c + 1); });
    const Status experts = ExpertsForward(ctx, cfg, prepared, options, cs);
    if (helper.joinable()) {
      helper.join();
    } else if (next) {
      pending = dispatch(c + 1);
    }
    FP8MOE_RETURN_IF_ERROR(experts);
    FP8MOE_RETURN_IF_ERROR(CombineForward(ctx, cs, Rows(y, ChunkRange(s, c))));
  }
  MoeStats& total = info->stats;
  total = {};
  for (const MoeStats& st : stats) {
    total.buffer_rows += st.buffer_rows;
    total.valid_rows += st.valid_rows;
    total.dropless_reruns = std::max(total.dropless_reruns, st.dropless_reruns);
  }
  return OkStatus();
}

Status ChunkedBackward(Context& ctx, const MoeConfig& cfg, const ConstTensorView& x,
                       const MoeWeights& w, const PreparedMoeWeights& prepared,
                       const MoeOptions& options, State& s, const ConstTensorView& dy,
                       const MoeGradientViews& grads) {
  const int64_t C = static_cast<int64_t>(s.chunks.size());
  FP8MOE_ASSIGN_OR_RETURN(s.dwv, Grow(&s.dweight, DType::kF32, {s.T * s.k}));
  FP8MOE_ASSIGN_OR_RETURN(TensorView dwi_c, Grow(&s.chunk_dwi, DType::kF32, w.wi.shape));
  FP8MOE_ASSIGN_OR_RETURN(TensorView dwo_c, Grow(&s.chunk_dwo, DType::kF32, w.wo.shape));
  for (int64_t c = 0; c < C; ++c) {
    State& cs = *s.chunks[static_cast<size_t>(c)];
    const ShardRange r = ChunkRange(s, c);
    FP8MOE_RETURN_IF_ERROR(CombineBackwardStage(ctx, options, cs, Rows(dy, r)));
    if (r.size() > 0) {
      std::memcpy(s.dwv.as<float>() + r.begin * s.k, cs.dwv.data,
                  static_cast<size_t>(r.size() * s.k) * sizeof(float));
    }
    // Chunk 0 writes the gradients; the others add theirs, in chunk order.
    const bool first = c == 0;
    FP8MOE_RETURN_IF_ERROR(ExpertsBackward(ctx, cfg, Rows(x, r), w, prepared, options, cs,
                                           first ? grads.dwi : dwi_c,
                                           first ? grads.dwo : dwo_c));
    if (!first) {
      for (const auto& [sum, part] : {std::pair{grads.dwi, dwi_c}, std::pair{grads.dwo, dwo_c}}) {
        FP8MOE_RETURN_IF_ERROR(Add(ctx, sum.as<float>(), part.as<float>(),
                                   static_cast<int64_t>(sum.num_elements()), sum.as<float>()));
      }
    }
  }
  FP8MOE_RETURN_IF_ERROR(
      RouteBackwardStage(ctx, cfg, x, w.router, s, grads.drouter, grads.dx));
  for (int64_t c = 0; c < C; ++c) {
    FP8MOE_RETURN_IF_ERROR(
        DispatchBackward(ctx, *s.chunks[static_cast<size_t>(c)], Rows(grads.dx, ChunkRange(s, c))));
  }
  return OkStatus();
}

}  // namespace fp8moe::internal
