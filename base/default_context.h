// The lock that makes DefaultContext() (context.h) safe to share: a Context
// is used by one calling thread at a time, and the calls without a Context
// (Gmm, GmmDlhs, Tgmm, the one-call MoeForward / MoeBackward) may come from
// several threads. Each holds this lock while it uses DefaultContext().
// Recursive, so a call holding it may make another such call.
#ifndef FP8MOE_BASE_DEFAULT_CONTEXT_H_
#define FP8MOE_BASE_DEFAULT_CONTEXT_H_

#include <mutex>

namespace fp8moe::internal {

std::recursive_mutex& DefaultContextMutex();

}  // namespace fp8moe::internal

#endif  // FP8MOE_BASE_DEFAULT_CONTEXT_H_
