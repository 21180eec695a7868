// Links fp8moe::mpi (exported when fp8moe was built with MPI) and runs as one
// rank without mpirun: the MPI library is linked but never initialised.
#include <cstdio>

#include "fp8moe/communicator.h"
#include "fp8moe/mpi.h"

int main() {
  if (fp8moe::LaunchedByMpi()) return 1;  // started plainly: no launcher
  auto comm = fp8moe::MakeSingleRankCommunicator();
  float x = 2.5f, y = 0.0f;
  if (!comm->AllReduce(&x, &y, 1, fp8moe::DType::kF32, fp8moe::ReduceOp::kSum).ok() ||
      y != 2.5f) {
    return 2;
  }
  std::printf("consumer_mpi: fp8moe::mpi found (%s)\n", fp8moe::MpiLibraryVersion().c_str());
  return 0;
}
