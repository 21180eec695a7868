// `fp8moe bench comm`, under mpirun: the ring collectives next to MPI's own
// (checked bit for bit) and a memcpy floor, and the bytes the trainer's
// gathers move (checked against the library's accounting) (the model:
// bench_comm.cc). Its ranks come as `fp8moe train`'s do (distributed/world.h).
// Reads json, reps, tokens, min_payload, max_payload.
#ifndef FP8MOE_BENCH_BENCH_COMM_H_
#define FP8MOE_BENCH_BENCH_COMM_H_

#include "bench/bench_options.h"

namespace fp8moe::bench {

int BenchComm(const BenchOptions& opt);

}  // namespace fp8moe::bench

#endif  // FP8MOE_BENCH_BENCH_COMM_H_
