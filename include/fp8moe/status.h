// Errors as values: Status (ok or a code plus a message) and Result<T> (a value
// or a Status). Every fallible public function returns one of these; nothing in
// the library throws across its API.
#ifndef FP8MOE_STATUS_H_
#define FP8MOE_STATUS_H_

#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace fp8moe {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // the caller passed something wrong; the message says what
  kNotFound,            // a named thing (file, tensor, key) does not exist
  kOutOfRange,          // an index, offset or size lies outside its bounds
  kDataLoss,            // a file is malformed or truncated
  kResourceExhausted,   // an allocation failed or would be too large
  kIoError,             // the operating system refused a read or write
  kFailedPrecondition,  // a valid request in the wrong state or configuration
  kInternal,            // a bug in fp8moe
};

// Short lower-case name of a code, e.g. "invalid argument".
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: <message>", or "ok".
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
inline Status InvalidArgument(std::string m) {
  return Status(StatusCode::kInvalidArgument, std::move(m));
}
inline Status NotFound(std::string m) {
  return Status(StatusCode::kNotFound, std::move(m));
}
inline Status OutOfRange(std::string m) {
  return Status(StatusCode::kOutOfRange, std::move(m));
}
inline Status DataLoss(std::string m) {
  return Status(StatusCode::kDataLoss, std::move(m));
}
inline Status ResourceExhausted(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
inline Status IoError(std::string m) {
  return Status(StatusCode::kIoError, std::move(m));
}
inline Status FailedPrecondition(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
inline Status Internal(std::string m) {
  return Status(StatusCode::kInternal, std::move(m));
}

// A value of type T or the Status saying why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) {
      v_ = Status(StatusCode::kInternal, "Result built from an ok Status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // The error; OkStatus() when a value is held.
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

  // Access the value; calling these on an error aborts (a programming bug).
  T& value() & { return Checked(); }
  const T& value() const& { return const_cast<Result*>(this)->Checked(); }
  T&& value() && { return std::move(Checked()); }
  T* operator->() { return &Checked(); }
  const T* operator->() const { return &const_cast<Result*>(this)->Checked(); }
  T& operator*() & { return Checked(); }
  T&& operator*() && { return std::move(Checked()); }
  const T& operator*() const& { return const_cast<Result*>(this)->Checked(); }

 private:
  T& Checked() {
    if (!ok()) std::abort();
    return std::get<T>(v_);
  }
  std::variant<T, Status> v_;
};

}  // namespace fp8moe

#define FP8MOE_CONCAT_INNER_(a, b) a##b
#define FP8MOE_CONCAT_(a, b) FP8MOE_CONCAT_INNER_(a, b)

// Returns the Status of `expr` from the enclosing function if it is an error.
#define FP8MOE_RETURN_IF_ERROR(expr)                  \
  do {                                                \
    ::fp8moe::Status fp8moe_status_ = (expr);         \
    if (!fp8moe_status_.ok()) return fp8moe_status_;  \
  } while (0)

// `lhs = value of expr`, or returns its error from the enclosing function.
#define FP8MOE_ASSIGN_OR_RETURN(lhs, expr)                                 \
  FP8MOE_ASSIGN_OR_RETURN_IMPL_(FP8MOE_CONCAT_(fp8moe_result_, __LINE__), \
                                lhs, expr)
#define FP8MOE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

#endif  // FP8MOE_STATUS_H_
