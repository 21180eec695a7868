// fp8moe._core: the nanobind module behind the `fp8moe` Python package. Its
// functions are low level (arrays as (array, dtype name) pairs, options as
// strings); python/fp8moe/ holds the documented API on top.
#include <omp.h>

#include <string>

#include "fp8moe/numerics.h"
#include "fp8moe/version.h"
#include "python/src/bind.h"

namespace fp8moe::py {

nb::dict FfiTargets() {
  nb::dict targets;
#ifdef FP8MOE_WITH_XLA_FFI
  AddGmmFfiTargets(targets);
  AddMoeFfiTargets(targets);
#endif
  return targets;
}

namespace {

void BindInfo(nb::module_& m) {
  m.def("version", [] { return std::string(kVersion); },
        "The library version (the package's version is the same string).");
  m.def("simd_target", [] { return std::string(SimdTargetName()); },
        "The SIMD target the kernels dispatch to on this CPU, e.g. 'AVX2'.");
  m.def("max_threads", [] { return omp_get_max_threads(); },
        "OpenMP threads a call from this Python thread uses.");
  m.def("set_num_threads", [](int n) {
    // libgomp allocates its thread table for n up front at the next parallel
    // region and exits the process when that fails (n = 2^31 - 1 asked for
    // 448 GiB): bounded here, far above any core count.
    constexpr int kMaxThreads = 1024;  // as `fp8moe bench --threads`
    if (n < 1 || n > kMaxThreads) {
      throw nb::value_error(("set_num_threads: n=" + std::to_string(n) +
                             " must be in [1, 1024]; the machine has " +
                             std::to_string(omp_get_num_procs()) + " processors")
                                .c_str());
    }
    omp_set_num_threads(n);
  }, nb::arg("n"), "Threads for calls made from the calling Python thread.");
  m.def("restrict_simd_target", [](const std::string& name) {
    ThrowIfError("restrict_simd_target", RestrictSimdTarget(name));
  }, nb::arg("name"),
        "Restricts run-time dispatch to `name` and the targets below it.");
  m.def("has_xla_ffi", [] { return FfiTargets().size() > 0; },
        "True if the module was built with the XLA FFI handlers.");
  m.def("ffi_targets", &FfiTargets,
        "{XLA FFI target name: PyCapsule of the handler} (empty without them).");
}

}  // namespace
}  // namespace fp8moe::py

NB_MODULE(_core, m) {
  m.doc() = "fp8moe C++ library bindings (low level; use the fp8moe package API)";
  fp8moe::py::BindInfo(m);
  fp8moe::py::BindNumerics(m);
  fp8moe::py::BindGmm(m);
  fp8moe::py::BindMoe(m);
}
