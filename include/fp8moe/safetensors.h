// Reading and writing safetensors files
// (https://github.com/huggingface/safetensors).
//
// Layout: an 8-byte little-endian u64 header length N, N bytes of UTF-8 JSON,
// then the byte buffer. The JSON maps each tensor name to
// {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]} (offsets into
// the byte buffer) and may hold "__metadata__": {string: string}.
//
// Dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL, F8_E4M3
// (e4m3fn) and F8_E5M2 (e5m2). The fnuz formats have no safetensors name; they
// are stored as U8 plus a metadata entry "<tensor>.format": "e4m3fnuz" or
// "e5m2fnuz". Metadata keys ending in ".format" are therefore reserved.
//
// The reader is strict, like the official implementation: the tensors, sorted
// by offset, must tile the byte buffer exactly (no overlaps, holes or trailing
// bytes), BOOL bytes must be 0 or 1 (anything else is not a valid bool), no
// key may appear twice in one JSON object (a tensor name, a metadata key or an
// entry field: JSON leaves the winner undefined), and the header may not start
// with a UTF-8 byte order mark (the official reader requires '{' first).
// Shapes follow tensor.h's CheckedNumElements: the nonzero dimensions must
// multiply to a size that fits, even when another dimension is 0 (stricter
// than the official reader for [0, 2^62]-like shapes, which no real file has).
// Error codes: kDataLoss for a malformed or truncated file,
// kInvalidArgument for a well-formed file we do not support (unknown dtype or
// format), kResourceExhausted for sizes over the limits, kNotFound / kIoError
// for files that cannot be opened or read.
#ifndef FP8MOE_SAFETENSORS_H_
#define FP8MOE_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fp8moe/status.h"
#include "fp8moe/tensor.h"

namespace fp8moe {

// The official implementation refuses headers longer than this; so do we.
inline constexpr size_t kSafetensorsMaxHeaderBytes = 100'000'000;

// The contents of one safetensors file.
struct SafetensorsFile {
  // Named tensors. Reading yields them in byte-buffer order (the order they
  // were written in); writing lays them out in this order.
  std::vector<std::pair<std::string, Tensor>> tensors;
  // User-visible "__metadata__" entries; the "<tensor>.format" entries that
  // encode fnuz dtypes are consumed by the reader and added by the writer.
  std::map<std::string, std::string> metadata;

  // The tensor named `name`, or nullptr.
  const Tensor* Find(std::string_view name) const;
  Tensor* Find(std::string_view name);
  // Appends a tensor; an error if the name is already taken.
  Status Add(std::string name, Tensor tensor);
};

// Parses a complete safetensors file held in memory; every tensor is copied
// into its own Tensor, so `data` may be freed afterwards.
Result<SafetensorsFile> ParseSafetensors(const uint8_t* data, size_t size);

// Reads the safetensors file at `path`. Tensor bytes are read straight into
// their Tensors (the file is never held in memory whole). Errors name `path`.
Result<SafetensorsFile> ReadSafetensors(const std::string& path);

// The exact bytes WriteSafetensors writes for `file`: compact JSON header with
// "__metadata__" first and the tensors in order, each entry as
// {"dtype","shape","data_offsets"} (as the official writer does), padded with
// spaces to a multiple of 8 bytes; the tensors contiguous in order.
Result<std::vector<uint8_t>> SerializeSafetensors(const SafetensorsFile& file);

// Writes `file` to `path` atomically: a temporary file in the same directory
// (`path`.tmp.PID.N, unique per process and call) is written, fsynced and
// renamed over `path`, then the directory is fsynced. On failure the
// temporary file is removed and `path` is left as it was. Two processes
// writing the same `path` leave one complete file (the last rename wins).
Status WriteSafetensors(const std::string& path, const SafetensorsFile& file);

// One tensor's entry in a file's header: what SafetensorsWriter lays out and
// SafetensorsReader lists.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  // Bytes of its data (elements x the dtype's size).
  uint64_t num_bytes() const;
};

// Writes a safetensors file one tensor at a time, so a file larger than the
// memory at hand (a checkpoint gathered tensor by tensor) can be written:
// the layout is declared first, the tensors' bytes follow in that order, and
// Finish makes the file appear as WriteSafetensors does (temporary file,
// fsync, rename, directory fsync; removed on a signal with
// RemoveTempFilesOnSignals). A writer destroyed before Finish succeeds
// removes its temporary file and leaves `path` as it was.
class SafetensorsWriter {
 public:
  // Checks the layout as WriteSafetensors does, creates the temporary file
  // and writes the header.
  static Result<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<SafetensorsEntry> entries,
      std::map<std::string, std::string> metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends `n` bytes of the data: the tensors' bytes back to back, in the
  // entries' order, in pieces of any size. After an error the writer is
  // spent (its temporary file removed) and every later call fails.
  Status Write(const void* data, size_t n);
  // After the last byte: rewrites the header with `metadata` (which may
  // replace values of the metadata given to Create, e.g. a checksum of the
  // data written under a placeholder of the same width; the header must
  // keep its length), then publishes the file.
  Status Finish(const std::map<std::string, std::string>& metadata);

 private:
  struct Impl;
  explicit SafetensorsWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Reads a safetensors file one tensor at a time: Open checks the header as
// ReadSafetensors does (the same errors), Read fills a caller's buffer with
// one tensor's bytes.
class SafetensorsReader {
 public:
  static Result<std::unique_ptr<SafetensorsReader>> Open(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  // The tensors in the order of their data in the file.
  const std::vector<SafetensorsEntry>& entries() const;
  // User-visible "__metadata__" entries (as SafetensorsFile::metadata).
  const std::map<std::string, std::string>& metadata() const;
  // The entry named `name`, or nullptr.
  const SafetensorsEntry* Find(std::string_view name) const;
  // Reads tensor `name`'s num_bytes() bytes into dst (BOOL bytes checked).
  // Errors name the path.
  Status Read(std::string_view name, void* dst) const;

 private:
  friend Result<SafetensorsFile> ReadSafetensors(const std::string& path);
  struct Impl;
  explicit SafetensorsReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Makes SIGINT, SIGTERM and SIGHUP first remove the temporary file of every
// WriteSafetensors in progress, then kill the process as the signal would
// have (exit status 128 + signal in a shell), so an interrupted write leaves
// `path` as it was and no temporary file. Signals the process ignores stay
// ignored; SIGKILL cannot be caught and may leave a `.tmp.` file (never a
// partial `path`). For commands: the library never installs handlers itself.
void RemoveTempFilesOnSignals();

}  // namespace fp8moe

#endif  // FP8MOE_SAFETENSORS_H_
