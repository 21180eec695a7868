// A job in which rank 1 fails while the others are inside a collective:
//   abort  rank 1 calls abort() (a crash)
//   exit   rank 1 calls _exit(3) without MPI_Finalize
//   hang   rank 1 sleeps forever
// fault_test.sh runs it under mpirun and checks that the job ends, non-zero,
// within a bound, with a message from every rank.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fp8moe/communicator.h"
#include "fp8moe/mpi.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: dist_fault_test abort|exit|hang TIMEOUT_SECONDS\n");
    return 2;
  }
  const std::string mode = argv[1];
  fp8moe::CommOptions options;
  options.timeout_seconds = std::atof(argv[2]);
  auto runtime = fp8moe::MpiRuntime::Start();
  if (!runtime.ok()) {
    std::fprintf(stderr, "%s\n", runtime.status().ToString().c_str());
    return 1;
  }
  auto world = (*runtime)->World(options);
  if (!world.ok()) {
    std::fprintf(stderr, "%s\n", world.status().ToString().c_str());
    return 1;
  }
  fp8moe::Communicator& comm = **world;
  std::vector<float> x(1 << 18, 1.0f), y(x.size());
  for (int step = 0; step < 6; ++step) {
    if (comm.rank() == 1 && step == 3) {
      std::fprintf(stderr, "fp8moe rank 1/%d: test: simulating a fault (%s) at step 3\n",
                   comm.size(), mode.c_str());
      std::fflush(stderr);
      if (mode == "abort") std::abort();
      if (mode == "exit") _exit(3);
      for (;;) pause();  // hang
    }
    const fp8moe::Status s = comm.AllReduce(x.data(), y.data(), static_cast<int64_t>(x.size()),
                                            fp8moe::DType::kF32, fp8moe::ReduceOp::kSum);
    if (!s.ok()) comm.Abort(1, s.ToString());
  }
  std::fprintf(stderr, "fp8moe rank %d/%d: finished all steps (no fault seen)\n", comm.rank(),
               comm.size());
  world->reset();
  runtime->reset();
  return 0;
}
