// Safetensors reader and writer. Depends only on base/, nlohmann_json and the
// standard library (plus POSIX file calls) so the fuzzer can build it alone.
#include "fp8moe/safetensors.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "fp8moe/memory.h"

namespace fp8moe {
namespace {

// The format is little-endian; we copy bytes as they are.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

using Json = nlohmann::json;

struct NamedDType {
  std::string_view name;
  DType dtype;
};
constexpr NamedDType kDTypes[] = {
    {"F64", DType::kF64},      {"F32", DType::kF32},
    {"F16", DType::kF16},      {"BF16", DType::kBF16},
    {"I64", DType::kI64},      {"I32", DType::kI32},
    {"I16", DType::kI16},      {"I8", DType::kI8},
    {"U64", DType::kU64},      {"U32", DType::kU32},
    {"U16", DType::kU16},      {"U8", DType::kU8},
    {"BOOL", DType::kBool},    {"F8_E4M3", DType::kE4M3FN},
    {"F8_E5M2", DType::kE5M2},
};
// Formats without a safetensors dtype, stored as U8 + "<name>.format".
constexpr NamedDType kFormats[] = {
    {"e4m3fnuz", DType::kE4M3FNUZ},
    {"e5m2fnuz", DType::kE5M2FNUZ},
};
constexpr std::string_view kFormatSuffix = ".format";
constexpr std::string_view kMetadataKey = "__metadata__";

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.substr(s.size() - suffix.size()) == suffix;
}

// A name quoted and escaped for an error message (names may hold anything).
std::string Quote(std::string_view s) {
  return Json(std::string(s))
      .dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string Range(uint64_t begin, uint64_t end) {
  // Appended piecewise: GCC 12 warns falsely (-Wrestrict) on "[" + string.
  std::string s = "[";
  s += std::to_string(begin);
  s += ", ";
  s += std::to_string(end);
  s += ')';
  return s;
}

std::string SupportedDTypes() {
  std::string s;
  for (const NamedDType& d : kDTypes) {
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

// The safetensors name for `dtype` ("U8" for the fnuz formats).
std::string_view StDTypeName(DType dtype) {
  for (const NamedDType& d : kDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "U8";
}

// One validated header entry.
struct Entry {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
  size_t header_pos = 0;  // position of the key in the JSON text
};

struct Header {
  std::vector<Entry> entries;  // sorted by data offset
  std::map<std::string, std::string> metadata;
};

Status EntryError(const std::string& name, const std::string& what) {
  return DataLoss("safetensors header: tensor " + Quote(name) + ": " + what);
}

// A non-negative JSON integer that fits `max`, or an error naming the value
// as `prefix` + index + `suffix` (built only on error: shapes can be long).
Status ToUint(const std::string& name, const char* prefix, size_t index,
              const char* suffix, const Json& v, uint64_t max, uint64_t* out) {
  if (v.is_number_unsigned() && v.get<uint64_t>() <= max) {
    *out = v.get<uint64_t>();
    return OkStatus();
  }
  const std::string what = prefix + std::to_string(index) + suffix;
  if (v.is_number_unsigned()) {
    return EntryError(name, what + " (" + std::to_string(v.get<uint64_t>()) +
                                ") is too large");
  }
  if (v.is_number_integer()) {
    return EntryError(
        name, what + " is negative (" + std::to_string(v.get<int64_t>()) + ")");
  }
  return EntryError(
      name, what + " is not an integer (" +
                v.dump(-1, ' ', false, Json::error_handler_t::replace) + ")");
}

// Looks up a required field of a tensor entry.
Result<const Json*> Field(const std::string& name, const Json& entry,
                          const char* field) {
  auto it = entry.find(field);
  if (it == entry.end()) {
    return EntryError(name, std::string("missing field \"") + field + "\"");
  }
  return &*it;
}

// Validates one tensor entry against a byte buffer of `buffer_size` bytes.
Status ParseEntry(const std::string& name, const Json& v, uint64_t buffer_size,
                  Entry* e) {
  e->name = name;
  if (!v.is_object()) return EntryError(name, "entry is not a JSON object");

  FP8MOE_ASSIGN_OR_RETURN(const Json* dtype, Field(name, v, "dtype"));
  if (!dtype->is_string()) {
    return EntryError(name, "field \"dtype\" is not a string");
  }
  const std::string& dname = dtype->get_ref<const std::string&>();
  const NamedDType* found = nullptr;
  for (const NamedDType& d : kDTypes) {
    if (d.name == dname) found = &d;
  }
  if (found == nullptr) {
    return InvalidArgument("safetensors header: tensor " + Quote(name) +
                           ": unsupported dtype " + Quote(dname) +
                           "; supported: " + SupportedDTypes());
  }
  e->dtype = found->dtype;

  FP8MOE_ASSIGN_OR_RETURN(const Json* shape, Field(name, v, "shape"));
  if (!shape->is_array()) {
    return EntryError(name, "field \"shape\" is not an array");
  }
  if (shape->size() > static_cast<size_t>(kMaxRank)) {
    return InvalidArgument("safetensors header: tensor " + Quote(name) + " has " +
                           std::to_string(shape->size()) + " dimensions; fp8moe holds at most " +
                           std::to_string(kMaxRank) + " (kMaxRank in fp8moe/tensor.h)");
  }
  for (size_t i = 0; i < shape->size(); ++i) {
    uint64_t d = 0;
    FP8MOE_RETURN_IF_ERROR(ToUint(name, "shape dimension ", i, "", (*shape)[i],
                                  std::numeric_limits<int64_t>::max(), &d));
    e->shape.push_back(static_cast<int64_t>(d));
  }
  auto n = CheckedNumElements(e->shape, DTypeSize(e->dtype));
  if (!n.ok()) {
    return ResourceExhausted("safetensors header: tensor " + Quote(name) +
                             ": " + n.status().message());
  }

  FP8MOE_ASSIGN_OR_RETURN(const Json* offsets, Field(name, v, "data_offsets"));
  if (!offsets->is_array() || offsets->size() != 2) {
    return EntryError(name,
                      "field \"data_offsets\" is not an array of 2 integers");
  }
  const uint64_t kMax = std::numeric_limits<uint64_t>::max();
  FP8MOE_RETURN_IF_ERROR(
      ToUint(name, "data_offsets[", 0, "]", (*offsets)[0], kMax, &e->begin));
  FP8MOE_RETURN_IF_ERROR(
      ToUint(name, "data_offsets[", 1, "]", (*offsets)[1], kMax, &e->end));
  if (e->begin > e->end) {
    return EntryError(name, "data_offsets begin " + std::to_string(e->begin) +
                                " is past end " + std::to_string(e->end));
  }
  if (e->end > buffer_size) {
    return EntryError(name, "data_offsets " + Range(e->begin, e->end) +
                                " lie outside the byte buffer of " +
                                std::to_string(buffer_size) + " bytes");
  }
  const uint64_t need = *n * DTypeSize(e->dtype);
  if (e->end - e->begin != need) {
    return EntryError(
        name, "data_offsets span " + std::to_string(e->end - e->begin) +
                  " bytes but shape " + ShapeToString(e->shape) + " of " +
                  dname + " needs " + std::to_string(need));
  }
  return OkStatus();
}

// Turns U8 tensors named by "<tensor>.format" entries into fnuz tensors and
// keeps the other metadata entries.
Status ApplyFormats(std::map<std::string, std::string> raw, Header* h) {
  std::map<std::string_view, Entry*> by_name;
  for (Entry& e : h->entries) by_name.emplace(e.name, &e);
  for (auto& [key, value] : raw) {
    if (!EndsWith(key, kFormatSuffix)) {
      h->metadata.emplace(key, std::move(value));
      continue;
    }
    const std::string_view tensor =
        std::string_view(key).substr(0, key.size() - kFormatSuffix.size());
    const std::string where = "safetensors __metadata__ entry " + Quote(key);
    const NamedDType* format = nullptr;
    for (const NamedDType& f : kFormats) {
      if (f.name == value) format = &f;
    }
    if (format == nullptr) {
      return InvalidArgument(where + ": unknown format " + Quote(value) +
                             "; supported: e4m3fnuz, e5m2fnuz");
    }
    auto it = by_name.find(tensor);
    if (it == by_name.end()) {
      return DataLoss(where + ": names no tensor " + Quote(tensor));
    }
    if (it->second->dtype != DType::kU8) {
      return DataLoss(where + ": tensor " + Quote(tensor) + " is " +
                      std::string(StDTypeName(it->second->dtype)) +
                      ", but a format can only be given for a U8 tensor");
    }
    it->second->dtype = format->dtype;
  }
  return OkStatus();
}

// Sorts the entries by offset and checks that they tile [0, buffer_size)
// exactly, as the official reader requires.
Status CheckTiling(uint64_t buffer_size, std::vector<Entry>* entries) {
  std::sort(entries->begin(), entries->end(),
            [](const Entry& a, const Entry& b) {
              if (a.begin != b.begin) return a.begin < b.begin;
              if (a.end != b.end) return a.end < b.end;
              return a.header_pos < b.header_pos;
            });
  uint64_t cursor = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : *entries) {
    if (e.begin < cursor) {
      return DataLoss("safetensors header: tensor " + Quote(e.name) +
                      " (bytes " + Range(e.begin, e.end) +
                      ") overlaps tensor " + Quote(prev->name) + " (bytes " +
                      Range(prev->begin, prev->end) + ")");
    }
    if (e.begin > cursor) {
      return DataLoss("safetensors header: bytes " + Range(cursor, e.begin) +
                      " of the byte buffer before tensor " + Quote(e.name) +
                      " belong to no tensor (a hole)");
    }
    cursor = e.end;
    prev = &e;
  }
  if (cursor != buffer_size) {
    return DataLoss("safetensors header: the last " +
                    std::to_string(buffer_size - cursor) +
                    " bytes of the byte buffer (from offset " +
                    std::to_string(cursor) + ") belong to no tensor");
  }
  return OkStatus();
}

// Parses and validates the JSON header for a byte buffer of `buffer_size`.
Result<Header> ParseHeader(const uint8_t* text, size_t size,
                           uint64_t buffer_size) {
  // Key positions at depth 1 give empty tensors sharing an offset a stable
  // order (the one they were written in); Json itself sorts keys by name.
  std::map<std::string, size_t> key_pos;
  // nlohmann stops at a NUL as if the input ended there, silently ignoring
  // what follows; valid JSON never holds a raw NUL, so refuse it here.
  if (const void* nul = size ? std::memchr(text, '\0', size) : nullptr) {
    return DataLoss(
        "safetensors header is not valid JSON: NUL byte at header offset " +
        std::to_string(static_cast<const uint8_t*>(nul) - text));
  }
  // nlohmann skips a leading UTF-8 byte order mark; the official reader
  // refuses any header that does not start with '{', so a BOM is refused
  // here too rather than accepted by one reader and not the other.
  if (size >= 3 && text[0] == 0xEF && text[1] == 0xBB && text[2] == 0xBF) {
    return DataLoss(
        "safetensors header starts with a UTF-8 byte order mark (EF BB BF); a "
        "header is plain JSON starting with '{' (the official reader refuses a "
        "BOM too): write the file without one");
  }
  // JSON leaves duplicate keys undefined and nlohmann keeps the last, so a
  // repeated tensor name, metadata key or entry field would silently pick one
  // of two values (another reader may pick the other): refuse them.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  size_t duplicate_depth = 0;
  Json root;
  try {
    root = Json::parse(
        text, text + size,
        [&](int depth, Json::parse_event_t event, Json& parsed) {
          if (event == Json::parse_event_t::object_start) {
            open_objects.emplace_back();
          } else if (event == Json::parse_event_t::object_end) {
            if (!open_objects.empty()) open_objects.pop_back();
          } else if (event == Json::parse_event_t::key) {
            const std::string& key = parsed.get_ref<const std::string&>();
            if (depth == 1) key_pos.emplace(key, key_pos.size());
            if (!open_objects.empty() && !open_objects.back().insert(key).second &&
                duplicate.empty()) {
              duplicate = key;
              duplicate_depth = open_objects.size();
            }
          }
          return true;
        });
  } catch (const Json::exception& ex) {
    // nlohmann quotes the bytes it last read, which in a damaged file may be
    // anything: escape them so the message is printable text.
    std::string what;
    for (const unsigned char c : std::string(ex.what())) {
      if (c >= 0x20 && c < 0x7f) {
        what += static_cast<char>(c);
      } else {
        char esc[5];
        std::snprintf(esc, sizeof(esc), "\\x%02X", c);
        what += esc;
      }
    }
    return DataLoss("safetensors header is not valid JSON: " + what);
  }
  if (!duplicate.empty()) {
    return DataLoss("safetensors header: key " + Quote(duplicate) + " appears twice in " +
                    (duplicate_depth == 1 ? std::string("the header (a tensor name or "
                                                        "__metadata__ given twice)")
                                          : std::string("one object")) +
                    "; names, metadata keys and fields must be unique (JSON readers "
                    "disagree on which copy wins)");
  }
  if (!root.is_object()) {
    return DataLoss("safetensors header is not a JSON object");
  }

  Header h;
  std::map<std::string, std::string> raw_metadata;
  h.entries.reserve(root.size());
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == kMetadataKey) {
      if (!it->is_object()) {
        return DataLoss("safetensors header: __metadata__ is not an object");
      }
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return DataLoss("safetensors header: __metadata__ entry " +
                          Quote(m.key()) + " is not a string");
        }
        raw_metadata.emplace(m.key(), m->get<std::string>());
      }
      continue;
    }
    Entry& e = h.entries.emplace_back();
    e.header_pos = key_pos[it.key()];
    FP8MOE_RETURN_IF_ERROR(ParseEntry(it.key(), *it, buffer_size, &e));
  }
  FP8MOE_RETURN_IF_ERROR(ApplyFormats(std::move(raw_metadata), &h));
  FP8MOE_RETURN_IF_ERROR(CheckTiling(buffer_size, &h.entries));
  return h;
}

// Checks the 8-byte prefix of a file of `file_size` bytes; returns N.
Result<uint64_t> HeaderLength(const uint8_t* prefix, uint64_t file_size) {
  if (file_size < 8) {
    return DataLoss("safetensors file is " + std::to_string(file_size) +
                    " bytes, shorter than its 8-byte header length");
  }
  uint64_t n = 0;
  std::memcpy(&n, prefix, 8);
  if (n > file_size - 8) {
    return DataLoss("safetensors header length " + std::to_string(n) +
                    " runs past the end of the file (" +
                    std::to_string(file_size) + " bytes)");
  }
  if (n > kSafetensorsMaxHeaderBytes) {
    return ResourceExhausted("safetensors header length " + std::to_string(n) +
                             " exceeds the limit of " +
                             std::to_string(kSafetensorsMaxHeaderBytes) +
                             " bytes");
  }
  return n;
}

// Bool tensors must hold 0 or 1: any other byte is not a valid C++ bool.
Status CheckBool(const Entry& e, const void* data) {
  if (e.dtype != DType::kBool) return OkStatus();
  const auto* p = static_cast<const uint8_t*>(data);
  for (uint64_t i = 0; i < e.end - e.begin; ++i) {
    if (p[i] > 1) {
      return DataLoss("safetensors: tensor " + Quote(e.name) +
                      ": BOOL element " + std::to_string(i) +
                      " has byte value " + std::to_string(p[i]) +
                      " (only 0 and 1 are valid)");
    }
  }
  return OkStatus();
}

// Allocates each tensor and lets `fill(entry, dst)` supply its bytes.
template <typename Fill>
Result<SafetensorsFile> Materialize(const Header& h, Fill fill) {
  SafetensorsFile file;
  file.metadata = h.metadata;
  // The whole file against the memory cap first, so a file too large to
  // hold is refused before anything is allocated, naming its largest tensor.
  uint64_t total = 0, largest = 0;
  const Entry* big = nullptr;
  for (const Entry& e : h.entries) {
    const uint64_t b = e.end - e.begin;
    total += b;  // the entries tile a buffer that fits in memory: no overflow
    if (big == nullptr || b > largest) {
      big = &e;
      largest = b;
    }
  }
  if (big != nullptr) {
    FP8MOE_RETURN_IF_ERROR(CheckMemoryRequest(
        "reading the file's " + std::to_string(h.entries.size()) +
            " tensors (the largest: " + Quote(big->name) + " " +
            std::string(DTypeName(big->dtype)) + " " + ShapeToString(big->shape) + ")",
        total));
  }
  file.tensors.reserve(h.entries.size());
  for (const Entry& e : h.entries) {
    auto created = Tensor::Create(e.dtype, e.shape);
    if (!created.ok()) {
      return Status(created.status().code(),
                    "tensor " + Quote(e.name) + ": " + created.status().message());
    }
    Tensor t = std::move(*created);
    if (t.num_bytes() > 0) FP8MOE_RETURN_IF_ERROR(fill(e, t.data()));
    FP8MOE_RETURN_IF_ERROR(CheckBool(e, t.data()));
    file.tensors.emplace_back(e.name, std::move(t));
  }
  return file;
}

// ---- POSIX helpers ----

std::string Errno(int err) { return std::strerror(err); }

Status OpenError(const std::string& path, int err) {
  std::string m = "cannot open '" + path + "': " + Errno(err);
  return err == ENOENT ? NotFound(std::move(m)) : IoError(std::move(m));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { Close(); }
  int get() const { return fd_; }
  // Closes the file held (if any) and holds `fd`.
  void Reset(int fd) {
    Close();
    fd_ = fd;
  }
  // Closes now; returns the errno of a failed close, or 0.
  int Close() {
    if (fd_ < 0) return 0;
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

// Reads exactly `n` bytes at `offset`.
Status PreadAll(int fd, void* dst, size_t n, uint64_t offset) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return IoError("read failed: " + Errno(errno));
    }
    if (got == 0) {
      return DataLoss(
          "the file ended early (was it truncated while being "
          "read?)");
    }
    p += got;
    n -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return OkStatus();
}

// Writes all `n` bytes; returns 0 or the errno.
int WriteAll(int fd, const void* src, size_t n) {
  const auto* p = static_cast<const uint8_t*>(src);
  while (n > 0) {
    const ssize_t put = ::write(fd, p, n);
    if (put < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += put;
    n -= static_cast<size_t>(put);
  }
  return 0;
}

Status WithPath(const std::string& path, const Status& s) {
  return Status(s.code(), path + ": " + s.message());
}

// The layout of `file`'s tensors, each checked to hold data.
Result<std::vector<SafetensorsEntry>> EntriesOf(const SafetensorsFile& file) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(file.tensors.size());
  for (const auto& [name, tensor] : file.tensors) {
    if (tensor.data() == nullptr) {
      return InvalidArgument("safetensors: tensor " + Quote(name) +
                             " holds no data (a default-constructed Tensor)");
    }
    entries.push_back({name, tensor.dtype(), tensor.shape()});
  }
  return entries;
}

// The 8-byte length and the padded JSON header for a file of `entries`
// (in data order) and `user_metadata`.
Result<std::string> BuildPrefix(
    const std::vector<SafetensorsEntry>& entries,
    const std::map<std::string, std::string>& user_metadata) {
  // Escaping goes through nlohmann so names with quotes or control characters
  // stay valid JSON; invalid UTF-8 is refused rather than written.
  auto quote = [](const std::string& s) -> Result<std::string> {
    try {
      return Json(s).dump(-1, ' ', false, Json::error_handler_t::strict);
    } catch (const Json::exception&) {
      return InvalidArgument("safetensors: " + Quote(s) +
                             " is not valid UTF-8");
    }
  };
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : user_metadata) {
    if (EndsWith(key, kFormatSuffix)) {
      return InvalidArgument(
          "safetensors: metadata key " + Quote(key) +
          " is reserved (keys ending in \".format\" encode fnuz dtypes)");
    }
    metadata.emplace(key, value);
  }
  std::set<std::string_view> names;
  for (const auto& [name, dtype, shape] : entries) {
    if (name == kMetadataKey) {
      return InvalidArgument(
          "safetensors: a tensor cannot be named "
          "\"__metadata__\"");
    }
    if (!names.insert(name).second) {
      return InvalidArgument("safetensors: duplicate tensor name " +
                             Quote(name));
    }
    for (const NamedDType& f : kFormats) {
      if (f.dtype == dtype) {
        metadata[name + std::string(kFormatSuffix)] = std::string(f.name);
      }
    }
  }

  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) json += ',';
      first = false;
      FP8MOE_ASSIGN_OR_RETURN(std::string k, quote(key));
      FP8MOE_ASSIGN_OR_RETURN(std::string v, quote(value));
      json += k + ':' + v;
    }
    json += '}';
  }
  uint64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    if (json.size() > 1) json += ',';
    FP8MOE_ASSIGN_OR_RETURN(std::string n, quote(e.name));
    json += n + ":{\"dtype\":\"" + std::string(StDTypeName(e.dtype)) +
            "\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) {
      if (i) json += ',';
      json += std::to_string(e.shape[i]);
    }
    const uint64_t end = offset + e.num_bytes();
    json += "],\"data_offsets\":[" + std::to_string(offset) + ',' +
            std::to_string(end) + "]}";
    offset = end;
  }
  json += '}';
  // Pad with spaces (valid JSON whitespace) so the buffer starts 8-aligned.
  json.append((8 - json.size() % 8) % 8, ' ');
  if (json.size() > kSafetensorsMaxHeaderBytes) {
    return ResourceExhausted("safetensors: header of " +
                             std::to_string(json.size()) +
                             " bytes exceeds the limit of " +
                             std::to_string(kSafetensorsMaxHeaderBytes));
  }
  const uint64_t n = json.size();
  std::string prefix(8, '\0');
  std::memcpy(prefix.data(), &n, 8);
  return prefix + json;
}

// ---- Temporary files a signal handler must remove ----
// A fixed table of paths, so the handler only reads memory and calls
// unlink (async-signal-safe). A slot is claimed, filled, then published.
constexpr int kTempSlots = 16;
constexpr size_t kTempPathMax = 4096;
struct TempSlot {
  std::atomic<int> state{0};  // 0 free, 1 being filled, 2 published
  char path[kTempPathMax];
};
TempSlot g_temp_slots[kTempSlots];

// Publishes `path`; returns the slot, or -1 if none is free or it is too long
// (the write still works, only without removal on a signal).
int RegisterTemp(const std::string& path) {
  if (path.size() >= kTempPathMax) return -1;
  for (int i = 0; i < kTempSlots; ++i) {
    int expected = 0;
    if (g_temp_slots[i].state.compare_exchange_strong(expected, 1)) {
      std::memcpy(g_temp_slots[i].path, path.c_str(), path.size() + 1);
      g_temp_slots[i].state.store(2);
      return i;
    }
  }
  return -1;
}

void UnregisterTemp(int slot) {
  if (slot >= 0) g_temp_slots[slot].state.store(0);
}

void RemoveTempFiles() {
  for (TempSlot& slot : g_temp_slots) {
    if (slot.state.load() == 2) ::unlink(slot.path);
  }
}

void OnTerminatingSignal(int sig) {
  RemoveTempFiles();
  // Die of the signal as the process would have without this handler, so a
  // shell sees 128 + sig and a parent sees the signal.
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

const Tensor* SafetensorsFile::Find(std::string_view name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

Tensor* SafetensorsFile::Find(std::string_view name) {
  for (auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

Status SafetensorsFile::Add(std::string name, Tensor tensor) {
  if (Find(name) != nullptr) {
    return InvalidArgument("safetensors: a tensor named " + Quote(name) +
                           " already exists");
  }
  tensors.emplace_back(std::move(name), std::move(tensor));
  return OkStatus();
}

Result<SafetensorsFile> ParseSafetensors(const uint8_t* data, size_t size) {
  if (data == nullptr && size != 0) {
    return InvalidArgument("ParseSafetensors: null data");
  }
  FP8MOE_ASSIGN_OR_RETURN(const uint64_t n, HeaderLength(data, size));
  const uint8_t* buffer = data + 8 + n;
  FP8MOE_ASSIGN_OR_RETURN(Header h, ParseHeader(data + 8, n, size - 8 - n));
  return Materialize(std::move(h), [buffer](const Entry& e, void* dst) {
    std::memcpy(dst, buffer + e.begin, e.end - e.begin);
    return OkStatus();
  });
}

uint64_t SafetensorsEntry::num_bytes() const { return NumElements(shape) * DTypeSize(dtype); }

// ---- SafetensorsReader ----

struct SafetensorsReader::Impl {
  std::string path;
  Fd fd{-1};
  Header header;
  uint64_t base = 0;  // the data buffer's offset in the file
  std::vector<SafetensorsEntry> entries;

  const Entry* FindEntry(std::string_view name) const {
    for (const Entry& e : header.entries) {
      if (e.name == name) return &e;
    }
    return nullptr;
  }
};

SafetensorsReader::SafetensorsReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsReader::~SafetensorsReader() = default;

Result<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->fd.Reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  const int fd = impl->fd.get();
  if (fd < 0) return OpenError(path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return IoError("cannot stat '" + path + "': " + Errno(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument("'" + path + "' is not a regular file");
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  // Every error past this point is prefixed with the path.
  uint8_t prefix[8] = {};
  if (file_size >= 8) {
    Status s = PreadAll(fd, prefix, 8, 0);
    if (!s.ok()) return WithPath(path, s);
  }
  auto n = HeaderLength(prefix, file_size);
  if (!n.ok()) return WithPath(path, n.status());
  std::vector<uint8_t> text(*n);
  Status s = PreadAll(fd, text.data(), *n, 8);
  if (!s.ok()) return WithPath(path, s);
  auto h = ParseHeader(text.data(), text.size(), file_size - 8 - *n);
  if (!h.ok()) return WithPath(path, h.status());
  impl->header = std::move(*h);
  impl->base = 8 + *n;
  for (const Entry& e : impl->header.entries) impl->entries.push_back({e.name, e.dtype, e.shape});
  return std::unique_ptr<SafetensorsReader>(new SafetensorsReader(std::move(impl)));
}

const std::vector<SafetensorsEntry>& SafetensorsReader::entries() const { return impl_->entries; }

const std::map<std::string, std::string>& SafetensorsReader::metadata() const {
  return impl_->header.metadata;
}

const SafetensorsEntry* SafetensorsReader::Find(std::string_view name) const {
  for (const SafetensorsEntry& e : impl_->entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Status SafetensorsReader::Read(std::string_view name, void* dst) const {
  const Entry* e = impl_->FindEntry(name);
  if (e == nullptr) {
    return NotFound(impl_->path + ": no tensor named " + Quote(name));
  }
  Status s = PreadAll(impl_->fd.get(), dst, e->end - e->begin, impl_->base + e->begin);
  if (s.ok()) s = CheckBool(*e, dst);
  return s.ok() ? s : WithPath(impl_->path, s);
}

Result<SafetensorsFile> ReadSafetensors(const std::string& path) {
  FP8MOE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader,
                          SafetensorsReader::Open(path));
  const SafetensorsReader::Impl& r = *reader->impl_;
  auto file = Materialize(r.header, [&](const Entry& e, void* dst) {
    return PreadAll(r.fd.get(), dst, e.end - e.begin, r.base + e.begin);
  });
  if (!file.ok()) return WithPath(path, file.status());
  return file;
}

void RemoveTempFilesOnSignals() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
    struct sigaction sa {};
    sa.sa_handler = OnTerminatingSignal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, nullptr);
  }
}

Result<std::vector<uint8_t>> SerializeSafetensors(const SafetensorsFile& file) {
  FP8MOE_ASSIGN_OR_RETURN(const std::vector<SafetensorsEntry> entries, EntriesOf(file));
  FP8MOE_ASSIGN_OR_RETURN(std::string prefix, BuildPrefix(entries, file.metadata));
  size_t total = prefix.size();
  for (const auto& [name, t] : file.tensors) total += t.num_bytes();
  std::vector<uint8_t> out;
  out.reserve(total);
  out.insert(out.end(), prefix.begin(), prefix.end());
  for (const auto& [name, t] : file.tensors) {
    const auto* p = static_cast<const uint8_t*>(t.data());
    out.insert(out.end(), p, p + t.num_bytes());
  }
  return out;
}

// ---- SafetensorsWriter ----

struct SafetensorsWriter::Impl {
  std::string path, tmp;
  Fd fd{-1};
  int slot = -1;  // the temporary file's signal-removal slot
  std::vector<SafetensorsEntry> entries;
  size_t prefix_bytes = 0;
  uint64_t data_bytes = 0, written = 0;
  bool spent = false;  // failed or finished

  // Removes the temporary file; the writer is spent.
  void Discard() {
    if (spent) return;
    spent = true;
    fd.Close();
    ::unlink(tmp.c_str());
    UnregisterTemp(slot);
  }
  Status Fail(const char* what, int err) {
    Discard();
    return IoError("cannot write '" + path + "': " + what + " '" + tmp + "': " + Errno(err));
  }
};

SafetensorsWriter::SafetensorsWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsWriter::~SafetensorsWriter() { impl_->Discard(); }

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<SafetensorsEntry> entries,
    std::map<std::string, std::string> metadata) {
  // Everything that can be checked is checked before the disk is touched.
  for (const SafetensorsEntry& e : entries) {
    auto n = CheckedNumElements(e.shape, DTypeSize(e.dtype));
    if (!n.ok()) {
      return Status(n.status().code(),
                    "safetensors: tensor " + Quote(e.name) + ": " + n.status().message());
    }
  }
  FP8MOE_ASSIGN_OR_RETURN(const std::string prefix, BuildPrefix(entries, metadata));
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  for (const SafetensorsEntry& e : entries) impl->data_bytes += e.num_bytes();
  impl->entries = std::move(entries);
  impl->prefix_bytes = prefix.size();

  // A fresh name per attempt, unique per process (pid) and per call
  // (counter); O_EXCL so two writers never share a temp file. Each candidate
  // is registered before it is created, so a signal arriving at any point
  // removes it (RemoveTempFilesOnSignals).
  static std::atomic<uint64_t> counter{0};
  int raw_fd = -1;
  for (int attempt = 0; attempt < 100 && raw_fd < 0; ++attempt) {
    impl->tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                std::to_string(counter.fetch_add(1));
    impl->slot = RegisterTemp(impl->tmp);
    raw_fd = ::open(impl->tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (raw_fd < 0) {
      const int err = errno;
      UnregisterTemp(impl->slot);
      errno = err;
      if (err != EEXIST) break;
    }
  }
  if (raw_fd < 0) {
    impl->spent = true;  // nothing to remove
    return IoError("cannot write '" + path + "': cannot create '" + impl->tmp +
                   "': " + Errno(errno));
  }
  impl->fd.Reset(raw_fd);
  if (int err = WriteAll(raw_fd, prefix.data(), prefix.size())) {
    return impl->Fail("write to", err);
  }
  return std::unique_ptr<SafetensorsWriter>(new SafetensorsWriter(std::move(impl)));
}

Status SafetensorsWriter::Write(const void* data, size_t n) {
  Impl& w = *impl_;
  if (w.spent) {
    return FailedPrecondition("cannot write '" + w.path + "': the writer has failed or finished");
  }
  if (n > w.data_bytes - w.written) {
    const uint64_t total = w.data_bytes;
    w.Discard();
    return InvalidArgument("cannot write '" + w.path + "': " + std::to_string(n) +
                           " more bytes would pass the " + std::to_string(total) +
                           " bytes its tensors hold");
  }
  if (int err = WriteAll(w.fd.get(), data, n)) return w.Fail("write to", err);
  w.written += n;
  return OkStatus();
}

Status SafetensorsWriter::Finish(const std::map<std::string, std::string>& metadata) {
  Impl& w = *impl_;
  if (w.spent) {
    return FailedPrecondition("cannot write '" + w.path + "': the writer has failed or finished");
  }
  if (w.written != w.data_bytes) {
    const uint64_t written = w.written, total = w.data_bytes;
    w.Discard();
    return InvalidArgument("cannot write '" + w.path + "': finished after " +
                           std::to_string(written) + " of its " + std::to_string(total) +
                           " data bytes");
  }
  auto prefix = BuildPrefix(w.entries, metadata);
  if (!prefix.ok()) {
    w.Discard();
    return prefix.status();
  }
  if (prefix->size() != w.prefix_bytes) {
    w.Discard();
    return InvalidArgument("cannot write '" + w.path + "': the final metadata changes the " +
                           "header's length (" + std::to_string(w.prefix_bytes) + " -> " +
                           std::to_string(prefix->size()) +
                           " bytes); give Create placeholders of the final values' width");
  }
  for (size_t done = 0; done < prefix->size();) {
    const ssize_t put = ::pwrite(w.fd.get(), prefix->data() + done, prefix->size() - done,
                                 static_cast<off_t>(done));
    if (put < 0) {
      if (errno == EINTR) continue;
      return w.Fail("write to", errno);
    }
    done += static_cast<size_t>(put);
  }
  if (::fsync(w.fd.get()) != 0) return w.Fail("fsync of", errno);
  if (int err = w.fd.Close()) return w.Fail("close of", err);
  if (::rename(w.tmp.c_str(), w.path.c_str()) != 0) {
    return w.Fail("rename onto the target of", errno);
  }
  UnregisterTemp(w.slot);  // a signal now would unlink a name that is gone
  w.spent = true;

  // Make the rename itself durable. Some file systems cannot fsync a
  // directory (EINVAL); the data is then as safe as they allow.
  const std::string dir = DirName(w.path);
  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0) {
    return IoError("wrote '" + w.path + "' but cannot open its directory '" +
                   dir + "' to fsync it: " + Errno(errno));
  }
  if (::fsync(dfd.get()) != 0 && errno != EINVAL) {
    return IoError("wrote '" + w.path + "' but cannot fsync its directory '" +
                   dir + "': " + Errno(errno));
  }
  return OkStatus();
}

Status WriteSafetensors(const std::string& path, const SafetensorsFile& file) {
  FP8MOE_ASSIGN_OR_RETURN(std::vector<SafetensorsEntry> entries, EntriesOf(file));
  FP8MOE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w,
                          SafetensorsWriter::Create(path, std::move(entries), file.metadata));
  for (const auto& [name, t] : file.tensors) {
    FP8MOE_RETURN_IF_ERROR(w->Write(t.data(), t.num_bytes()));
  }
  return w->Finish(file.metadata);
}

}  // namespace fp8moe
