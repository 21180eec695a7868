// The sgemm ceiling: in this process when OpenBLAS loaded a core right for
// the CPU, else in a child process (this same binary, `fp8moe bench sgemm
// --sizes ... --json`) whose OPENBLAS_CORETYPE names a right core; OpenBLAS
// reads that variable only while it is being loaded.
#include "bench/sgemm_ceiling.h"

#include <cblas.h>
#include <fcntl.h>
#include <omp.h>
#include <poll.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "bench/bench_util.h"
#include "bench/openblas_core.h"
#include "fp8moe/numerics.h"
#include "fp8moe/tensor.h"

extern char** environ;

namespace fp8moe::bench {
namespace {

constexpr int64_t kMaxSide = int64_t{1} << 20;

// A tensor of `n` floats in [-0.5, 0.5) from a cheap hash: sgemm's speed does
// not depend on the values as long as they are normal, and hashing is much
// faster than drawing normals for the large shapes.
Tensor Filled(int64_t rows, int64_t cols, uint32_t salt) {
  Tensor t = MustCreate(DType::kF32, {rows, cols});
  float* p = t.data_as<float>();
  for (size_t i = 0; i < t.num_elements(); ++i) {
    const uint32_t h = (static_cast<uint32_t>(i) + salt) * 2654435761u;
    p[i] = static_cast<float>(h >> 8) / 16777216.0f - 0.5f;
  }
  return t;
}

// One shape's operands, and sgemm on them with this process's core.
class SgemmHere {
 public:
  SgemmHere(const SgemmShape& shape, int threads)
      : shape_(shape),
        threads_(threads),
        a_(Filled(shape.m, shape.k, 1)),
        b_(Filled(shape.k, shape.n, 2)),
        c_(MustCreate(DType::kF32, {shape.m, shape.n})) {}

  // C [m, n] = A [m, k] x B [k, n] once, on `threads` OpenBLAS threads.
  void Run() {
    openblas_set_num_threads(threads_);
    const int m = static_cast<int>(shape_.m), k = static_cast<int>(shape_.k);
    const int n = static_cast<int>(shape_.n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a_.data_as<float>(), k,
                b_.data_as<float>(), n, 0.0f, c_.data_as<float>(), n);
  }

 private:
  SgemmShape shape_;
  int threads_;
  Tensor a_, b_, c_;
};

std::vector<double> RunSgemmHere(const std::vector<SgemmShape>& shapes, int threads, int reps) {
  std::vector<double> seconds;
  for (const SgemmShape& s : shapes) {
    SgemmHere here(s, threads);
    seconds.push_back(BestSeconds(reps, [&] { here.Run(); }));
  }
  return seconds;
}

// This process's environment with each of `set` ("NAME=value") replacing
// any NAME there.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& set) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    bool replaced = false;
    for (const std::string& kv : set) {
      const size_t eq = kv.find('=') + 1;
      replaced = replaced || std::strncmp(*e, kv.c_str(), eq) == 0;
    }
    if (!replaced) env.emplace_back(*e);
  }
  env.insert(env.end(), set.begin(), set.end());
  return env;
}

// Starts this binary with `args` and `env`, its stdin (unless -1) and
// stdout on the given descriptors; false (and why in *error) if it cannot.
bool SpawnSelf(const std::vector<std::string>& args, std::vector<std::string> env, int stdin_fd,
               int stdout_fd, pid_t* pid, std::string* error) {
  std::vector<char*> envp, argv;
  for (std::string& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> arg_store = args;
  for (std::string& s : arg_store) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  // dup2 clears O_CLOEXEC on the copy.
  if (stdin_fd >= 0) posix_spawn_file_actions_adddup2(&fa, stdin_fd, STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&fa, stdout_fd, STDOUT_FILENO);
  // /proc/self/exe is resolved by the new process, which is still this binary then.
  const int rc = posix_spawn(pid, "/proc/self/exe", &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) *error = std::string("could not start a child: ") + std::strerror(rc);
  return rc == 0;
}

// Why a child that ended with `status` failed, or "" if it exited 0.
std::string ChildFailure(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "child killed by signal " + std::to_string(sig) +
           (sig == SIGILL ? " (SIGILL: the core needs instructions this CPU lacks)" : "");
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return "child exited with status " + std::to_string(WEXITSTATUS(status));
  }
  return "";
}

int WaitChild(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// The path of this binary (argv[0] of its children).
std::string SelfPath() {
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  return len > 0 ? std::string(self, static_cast<size_t>(len)) : "fp8moe";
}

// Runs this binary with `args` and OPENBLAS_CORETYPE=coretype; its stdout in
// *out. False (and why in *error) if it could not start or did not exit 0.
bool RunChild(const std::vector<std::string>& args, const std::string& coretype,
              std::string* out, std::string* error) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    *error = std::string("pipe: ") + std::strerror(errno);
    return false;
  }
  pid_t pid = 0;
  const bool started =
      SpawnSelf(args, ChildEnvironment({"OPENBLAS_CORETYPE=" + coretype}), -1, fds[1], &pid, error);
  close(fds[1]);
  if (!started) {
    close(fds[0]);
    return false;
  }
  char buf[4096];
  ssize_t got;
  while ((got = read(fds[0], buf, sizeof(buf))) > 0 || (got < 0 && errno == EINTR)) {
    if (got > 0) out->append(buf, static_cast<size_t>(got));
  }
  close(fds[0]);
  *error = ChildFailure(WaitChild(pid));
  return error->empty();
}

struct ChildRun {
  std::string core, config;
  std::vector<double> seconds;
};

bool RunSgemmChild(const std::vector<SgemmShape>& shapes, int threads, int reps,
                   const std::string& coretype, ChildRun* run, std::string* error) {
  std::string out;
  if (!RunChild({SelfPath(), "bench", "sgemm", "--sizes", FormatSgemmShapes(shapes), "--threads",
                 std::to_string(threads), "--reps", std::to_string(reps), "--json"},
                coretype, &out, error)) {
    return false;
  }
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("rows") || !j["rows"].is_array() ||
      j["rows"].size() != shapes.size() || !j.contains("openblas_core")) {
    *error = "child printed no usable JSON";
    return false;
  }
  run->core = j["openblas_core"].get<std::string>();
  run->config = j.value("openblas_config", "");
  for (const auto& r : j["rows"]) run->seconds.push_back(r.value("seconds", 0.0));
  return true;
}

}  // namespace

std::string FormatSgemmShapes(const std::vector<SgemmShape>& shapes) {
  std::string s;
  for (const SgemmShape& x : shapes) {
    if (!s.empty()) s += ",";
    s += std::to_string(x.m) + "x" + std::to_string(x.k) + "x" + std::to_string(x.n);
  }
  return s;
}

bool ParseSgemmShapes(const std::string& text, std::vector<SgemmShape>* shapes,
                      std::string* error) {
  shapes->clear();
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    long long m = 0, k = 0, n = 0;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%lldx%lldx%lld%c", &m, &k, &n, &tail) != 3 || m < 1 ||
        k < 1 || n < 1 || m > kMaxSide || k > kMaxSide || n > kMaxSide) {
      *error = "'" + item + "' is not MxKxN with each size in [1, 1048576] (e.g. 2048x2048x2048)";
      return false;
    }
    shapes->push_back({m, k, n});
  }
  if (shapes->empty()) {
    *error = "no sizes given; use MxKxN[,MxKxN...]";
    return false;
  }
  return true;
}

SgemmCeiling MeasureSgemmCeiling(const std::vector<SgemmShape>& shapes, int threads, int reps,
                                 const std::string& force_core) {
  SgemmCeiling c;
  c.loaded_core = openblas_get_corename();
  c.loaded_config = openblas_get_config();
  // The SIMD target's class, not the CPU's, under --simd below the CPU.
  const CpuIsa isa = CapToSimdTarget(DetectCpuIsa(), SimdTargetName());
  const CoreAdvice advice = AdviseCore(c.loaded_core, isa);
  c.loaded_fallback = advice.fallback;
  c.advice = advice.why;
  if (force_core.empty() && !advice.fallback) {
    c.core = c.loaded_core;
    c.config = c.loaded_config;
    c.trusted = true;
    c.seconds = RunSgemmHere(shapes, threads, reps);
    return c;
  }
  const std::vector<std::string> tries =
      force_core.empty() ? advice.coretypes : std::vector<std::string>{force_core};
  bool have_reference = false;
  for (const std::string& t : tries) {
    ChildRun run;
    std::string error;
    if (!RunSgemmChild(shapes, threads, reps, t, &run, &error)) {
      c.attempts.push_back("OPENBLAS_CORETYPE=" + t + ": " + error);
      continue;
    }
    const CoreAdvice judged = AdviseCore(run.core, isa);
    c.attempts.push_back("OPENBLAS_CORETYPE=" + t + ": core " + run.core + " (" +
                         (judged.fallback ? "rejected: " + judged.why : "right for this CPU") +
                         ")");
    if (!judged.fallback || !have_reference) {
      c.core = run.core;
      c.config = run.config;
      c.coretype_env = t;
      c.seconds = run.seconds;
      have_reference = true;
    }
    if (!judged.fallback) {
      c.trusted = true;
      return c;
    }
  }
  // No right core: keep some numbers for reference only. The loaded core
  // runs here unless it needs instructions the CPU lacks (a forced core).
  IsaTier tier;
  const bool runnable = !CoreTier(c.loaded_core, &tier) || tier <= TierOf(isa);
  if (!have_reference && runnable) {
    c.core = c.loaded_core;
    c.config = c.loaded_config;
    c.seconds = RunSgemmHere(shapes, threads, reps);
  }
  if (c.seconds.empty()) c.seconds.assign(shapes.size(), 0.0);
  std::string tried;
  for (const std::string& a : c.attempts) tried += "; " + a;
  std::fprintf(stderr,
               "WARNING: no OpenBLAS core right for this %s CPU could be had (%s%s); sgemm is "
               "NOT a ceiling in this run, the benchmark compares with the measured f32 FMA "
               "peak instead\n",
               std::string(IsaTierName(TierOf(isa))).c_str(),
               force_core.empty() ? c.advice.c_str() : "--sgemm-core asked for one core only",
               tried.c_str());
  return c;
}

namespace {

// A child that says nothing for this long is taken for stuck (one sgemm of
// the benches' shapes takes well under a second).
constexpr int kChildSilenceMs = 300 * 1000;

// One line from `fd` without its newline; false at end of file, on error,
// or after kChildSilenceMs without a byte.
bool ReadLine(int fd, std::string* line) {
  line->clear();
  char ch;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, kChildSilenceMs);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    const ssize_t got = read(fd, &ch, 1);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    if (ch == '\n') return true;
    line->push_back(ch);
  }
}

bool SendAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t put = send(fd, text.data() + done, text.size() - done, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    done += static_cast<size_t>(put);
  }
  return true;
}

}  // namespace

std::unique_ptr<SgemmRounds> SgemmRounds::Start(const SgemmCeiling& ceiling,
                                                const std::vector<SgemmShape>& shapes,
                                                int threads, std::string* error) {
  if (!ceiling.trusted) {
    *error = "no OpenBLAS core right for this CPU to time";
    return nullptr;
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    *error = std::string("socketpair: ") + std::strerror(errno);
    return nullptr;
  }
  std::vector<std::string> set = {"OPENBLAS_THREAD_TIMEOUT=4"};
  if (!ceiling.coretype_env.empty()) set.push_back("OPENBLAS_CORETYPE=" + ceiling.coretype_env);
  pid_t pid = 0;
  const bool started =
      SpawnSelf({SelfPath(), "bench", "sgemm", "--serve", "--sizes", FormatSgemmShapes(shapes),
                 "--threads", std::to_string(threads)},
                ChildEnvironment(set), sv[1], sv[1], &pid, error);
  close(sv[1]);
  if (!started) {
    close(sv[0]);
    return nullptr;
  }
  std::unique_ptr<SgemmRounds> rounds(new SgemmRounds(sv[0], pid));
  std::string line;
  if (!ReadLine(sv[0], &line) || line.rfind("core ", 0) != 0) {
    *error = "the sgemm child did not say its core";
    return nullptr;  // the destructor ends and reaps it
  }
  if (line.substr(5) != ceiling.core) {
    *error = "the sgemm child loaded core " + line.substr(5) + ", not the ceiling's " + ceiling.core;
    return nullptr;
  }
  return rounds;
}

SgemmRounds::~SgemmRounds() {
  close(fd_);  // the child reads end of file and exits
  kill(pid_, SIGTERM);  // or, if it is stuck, is ended
  WaitChild(pid_);
}

double SgemmRounds::Run(size_t i) {
  std::string line;
  if (!SendAll(fd_, std::to_string(i) + "\n") || !ReadLine(fd_, &line)) {
    std::fprintf(stderr, "error: the sgemm child (bench sgemm --serve) stopped answering (it "
                 "ended, or said nothing for %d s)\n", kChildSilenceMs / 1000);
    std::exit(1);
  }
  char* end = nullptr;
  const double seconds = std::strtod(line.c_str(), &end);
  if (end == line.c_str() || !(seconds > 0)) {
    std::fprintf(stderr, "error: the sgemm child answered '%s', not a time\n", line.c_str());
    std::exit(1);
  }
  return seconds;
}

std::vector<std::string> SgemmNotes(const SgemmCeiling& c) {
  std::vector<std::string> notes;
  if (c.trusted && c.coretype_env.empty()) {
    notes.push_back("sgemm ceiling: OpenBLAS core " + c.core + " in this process (" + c.advice +
                    "); " + c.config);
  } else if (c.trusted) {
    notes.push_back("sgemm ceiling: OpenBLAS core " + c.core +
                    ", measured in a child process with OPENBLAS_CORETYPE=" + c.coretype_env +
                    "; this process loaded " + c.loaded_core + " (" + c.advice + ")");
  } else {
    notes.push_back("!!! WARNING: NO TRUSTED SGEMM CEILING (every core tried is listed below); "
                    "this process loaded " + c.loaded_core + " (" + c.advice + ")" +
                    (c.core.empty() ? std::string("") : "; numbers shown from core " + c.core) +
                    ". 'x sgemm' is replaced by the ratio to the measured f32 FMA peak.");
  }
  for (const std::string& a : c.attempts) notes.push_back("  tried " + a);
  return notes;
}

nlohmann::json SgemmJson(const SgemmCeiling& c, const std::vector<SgemmShape>& shapes) {
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < shapes.size(); ++i) {
    rows.push_back({{"m", shapes[i].m}, {"k", shapes[i].k}, {"n", shapes[i].n},
                    {"seconds", c.seconds[i]}, {"gflops", c.Gflops(shapes, i)}});
  }
  return {{"loaded_core", c.loaded_core}, {"loaded_config", c.loaded_config},
          {"loaded_fallback", c.loaded_fallback}, {"advice", c.advice}, {"core", c.core},
          {"config", c.config}, {"coretype_env", c.coretype_env}, {"trusted", c.trusted},
          {"cpu_isa", std::string(IsaTierName(TierOf(CapToSimdTarget(DetectCpuIsa(), SimdTargetName()))))},
          {"attempts", c.attempts}, {"shapes", rows}};
}

namespace {

// How long `bench sgemm --serve` waits after a request before it starts its
// clock (SgemmRounds says why).
constexpr double kServeSettleSeconds = 0.02;

// `bench sgemm --serve`: SgemmRounds' child. Says its core, then for each
// shape index read from stdin runs that shape once and prints its seconds;
// exits at end of input.
int ServeSgemm(const std::vector<SgemmShape>& shapes, int threads) {
  std::printf("core %s\n", openblas_get_corename());
  std::fflush(stdout);
  std::unique_ptr<SgemmHere> here;
  size_t current = shapes.size();
  char line[64];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    line[std::strcspn(line, "\n")] = '\0';  // the message quotes the request alone
    char* end = nullptr;
    const unsigned long i = std::strtoul(line, &end, 10);
    if (end == line || *end != '\0' || i >= shapes.size()) {
      std::fprintf(stderr, "error: bench sgemm --serve: '%s' is not a shape index below %zu\n",
                   line, shapes.size());
      return 2;
    }
    if (i != current) {
      here.reset();  // one shape's buffers at a time
      here = std::make_unique<SgemmHere>(shapes[i], threads);
      current = i;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(kServeSettleSeconds));
    const double t0 = NowSeconds();
    here->Run();
    std::printf("%.9e\n", NowSeconds() - t0);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int BenchSgemm(const BenchOptions& opt) {
  std::vector<SgemmShape> shapes;
  std::string error;
  if (!ParseSgemmShapes(opt.sgemm_sizes, &shapes, &error)) {
    std::fprintf(stderr, "error: --sizes: %s\n", error.c_str());
    return 2;
  }
  omp_set_num_threads(opt.threads);
  if (opt.sgemm_serve) return ServeSgemm(shapes, opt.threads);
  const std::string core = openblas_get_corename();
  const CoreAdvice advice = AdviseCore(core, DetectCpuIsa());
  const std::vector<double> seconds = RunSgemmHere(shapes, opt.threads, opt.reps);
  if (opt.json) {
    nlohmann::json rows = nlohmann::json::array();
    for (size_t i = 0; i < shapes.size(); ++i) {
      rows.push_back({{"m", shapes[i].m}, {"k", shapes[i].k}, {"n", shapes[i].n},
                      {"seconds", seconds[i]}, {"gflops", shapes[i].Flops() / seconds[i] / 1e9}});
    }
    const nlohmann::json j = {{"bench", "sgemm"},         {"threads", opt.threads},
                              {"openblas_core", core},    {"openblas_config", openblas_get_config()},
                              {"fallback", advice.fallback}, {"advice", advice.why},
                              {"rows", rows}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  Table t;
  t.title = "fp8moe bench sgemm: OpenBLAS as loaded (set OPENBLAS_CORETYPE to pick a core), " +
            std::to_string(opt.threads) + " threads";
  t.columns = {"M x K x N", "ms", "GFLOP/s"};
  for (size_t i = 0; i < shapes.size(); ++i) {
    t.rows.push_back({FormatSgemmShapes({shapes[i]}), Fixed(seconds[i] * 1e3, 2),
                      Fixed(shapes[i].Flops() / seconds[i] / 1e9, 1)});
  }
  t.notes.push_back(std::string(advice.fallback ? "!!! WARNING: " : "") + advice.why + "; " +
                    openblas_get_config());
  t.Print();
  return 0;
}

}  // namespace fp8moe::bench
