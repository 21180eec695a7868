// StartWorld with MPI linked: MPI under an MPI launcher, else one rank (MPI
// stays uninitialised, so `fp8moe` runs without mpirun as before).
#include "distributed/world.h"
#include "fp8moe/mpi.h"

namespace fp8moe {
namespace {

class MpiWorld final : public World {
 public:
  explicit MpiWorld(std::unique_ptr<MpiRuntime> runtime) : runtime_(std::move(runtime)) {}
  Result<std::unique_ptr<Communicator>> Open(const CommOptions& options) override {
    return runtime_->World(options);
  }
  std::string Describe() const override {
    return "mpi (" + MpiLibraryVersion() + "), " + std::to_string(runtime_->world_size()) +
           " ranks";
  }
  bool BarrierWithin(double seconds) override { return runtime_->BarrierWithin(seconds); }

 private:
  std::unique_ptr<MpiRuntime> runtime_;
};

class SingleWorld final : public World {
 public:
  Result<std::unique_ptr<Communicator>> Open(const CommOptions&) override {
    return MakeSingleRankCommunicator();
  }
  std::string Describe() const override {
    return "single rank (not started by mpirun; run `mpirun -np N fp8moe ...` for N ranks)";
  }
  bool BarrierWithin(double) override { return true; }
};

}  // namespace

Result<std::unique_ptr<World>> StartWorld() {
  if (!LaunchedByMpi()) return std::unique_ptr<World>(new SingleWorld);
  FP8MOE_ASSIGN_OR_RETURN(auto runtime, MpiRuntime::Start());
  return std::unique_ptr<World>(new MpiWorld(std::move(runtime)));
}

std::string MpiInfo() {
  return MpiLibraryVersion() + (LaunchedByMpi() ? " (started by an MPI launcher)"
                                                : " (linked; `mpirun -np N fp8moe ...` runs N ranks)");
}

}  // namespace fp8moe
