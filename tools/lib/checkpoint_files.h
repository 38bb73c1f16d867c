// Checkpoint files: sharded save of every rank's shardedStateDict (core/checkpoint.h) into
// safetensors files plus one index, and load at any other topology (TP, GTP_remat, padding, dtype).
//
// Layout (docs/checkpoints.md): one `rank-RRRRR.safetensors` per writing rank, holding the real rows
// of the chunks whose replica it is main of (GTP_remat pad rows are never written), and
// `index.json`, written last, naming every key's shapes, dtype and chunks with a checksum each, and
// carrying a checksum of itself. A load trusts nothing it has not checked: the index's checksum,
// every chunk against its file's header, the chunks' tiling of each tensor. It maps saved and target
// chunks to logical (unpadded) global rows, so any topology reads any checkpoint. Not a distributed
// file system: every rank's data passes through this process's memory.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backends/compute.h"
#include "core/checkpoint.h"
#include "tools/lib/input_file.h"
#include "core/placement.h"

namespace tpsim {
namespace tools {
class DirectoryReadLock;  // tools/lib/output_files.h
}

// The safetensors name of a dtype ("F32", "BF16", ...) and its inverse (nullopt if unknown).
const char* safetensorsDtype(DType dtype);
std::optional<DType> parseSafetensorsDtype(const std::string& name);

// FNV-1a, 64 bit: the checksum of every stored byte range (header, chunk data) in the index.
std::uint64_t fnv1a64(const void* data, std::size_t size);

// A safetensors file's bytes: `tensors` in order, each a name, dtype, shape and row-major
// little-endian bytes.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::vector<char> bytes;
};
std::string safetensorsBytes(const std::vector<SafetensorsEntry>& tensors,
                             const std::map<std::string, std::string>& metadata = {});

// One tensor of a safetensors header: its bytes are data_offsets [begin, end) of the data, which
// starts after the 8-byte length and the header.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;
};
// The header length n of the safetensors file `bytes` (its first 8 bytes, little-endian), checked
// to fit in the file: the header is bytes [8, 8 + n).
std::uint64_t safetensorsHeaderLength(const std::vector<char>& bytes, const std::string& where);
// The same from the file's first min(8, fileSize) bytes, `first`, and its size, before the rest is read.
std::uint64_t safetensorsHeaderLength(const char* first, std::uint64_t fileSize, const std::string& where);
// The header of the safetensors file `bytes`, read as strictly as a checkpoint's index: a JSON object
// (nesting and duplicate keys refused), `__metadata__` of strings, every tensor a known dtype, an
// integer shape and data_offsets holding exactly its bytes, and the offsets indexing every data
// byte once (no overlap, no hole before, between or after the tensors). Sorted by offsets. Throws
// InvalidArgument naming `where`, the tensor and the offsets.
std::vector<SafetensorsTensor> readSafetensorsHeader(const std::vector<char>& bytes, const std::string& where);
// The same from the header's n bytes alone, `text`, and the size of the data after them in the
// file: a file's tensors are checked against its size before its data is read.
std::vector<SafetensorsTensor> readSafetensorsHeader(const char* text, std::uint64_t n, std::uint64_t dataSize,
                                                     const std::string& where);

// One chunk as the index records it. Coordinates are global, over prependAxisNum + data axes.
struct CheckpointChunk {
  std::string file, tensor;                       // the safetensors file and the tensor's name in it
  int writer = 0;                                 // the rank that wrote it
  std::vector<std::int64_t> globalOffset;         // in the saved (padded) global tensor
  std::vector<std::int64_t> localShape;           // as the rank held it, pad rows included
  std::vector<std::int64_t> storedShape;          // what the file holds: pad rows left out
  int paddedAxis = 0;                             // the axis pad rows sit on (prependAxisNum)
  std::optional<GtpPadding> gtpPadding;
  ReplicaId replicaId;
  std::uint64_t checksum = 0;                     // fnv1a64 of the stored bytes
  std::uint64_t dataBegin = 0, dataEnd = 0;       // the stored bytes in the file's data (its data_offsets)
};

struct CheckpointKey {
  std::string key;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> globalShape;       // logical: without pad rows (what consolidate writes)
  std::vector<std::int64_t> savedGlobalShape;  // Megatron's: with the saving topology's pad rows
  std::vector<CheckpointChunk> chunks;
  std::string placement;  // how the saving run placed it (placementText); empty if not recorded
};

// An `_extra_state` entry (value None): which cells were recorded, and by whom.
struct CheckpointObject {
  std::string key;
  std::vector<std::int64_t> globalShape;
  std::vector<std::vector<std::int64_t>> offsets;
  std::vector<int> writers;
};

// Collects the state dicts of one world and writes them. add() is called by every rank, from its
// own thread; commit() once all have returned.
class CheckpointWriter {
 public:
  // `layer`: the kind of layer saved (tpsim run's --layer), recorded in the index for a load to
  // compare with its own; "" records none.
  explicit CheckpointWriter(std::string layer = "") : layer_(std::move(layer)) {}
  // Copies this rank's main-replica chunks to host memory (through compute), real rows only.
  void add(int rank, const ShardedStateDict& stateDict, Compute& compute);
  // Records the saving run's placement of a key (core/placement.h) in the index, for people and
  // tools reading it; a load does not depend on it.
  void describe(const TensorPlacement& placement);
  // Writes the files and the index into `dir`, which must exist. Throws InvalidArgument, writing
  // nothing, when a chunk is written twice, a key's chunks leave rows uncovered or disagree on dtype,
  // shape or padding, or the index would be larger than a load reads. Every file is written to a
  // temporary first; then, under the directory's lock, the old index is removed, the files are
  // renamed into place and the index last (docs/checkpoints.md, "Saving"): an index there always
  // names the files written with it.
  void commit(const std::string& dir) const;
  // What this writer holds of the ranks' add() calls, as bytes (backends/wire.h), and its inverse,
  // which adds another writer's to this one: a world spread over an MPI job saves through process
  // 0's writer, and commit() writes the same files as one process's.
  std::string packed() const;
  void addPacked(const std::string& bytes);

 private:
  struct Held {
    CheckpointChunk chunk;
    std::vector<std::int64_t> savedGlobalShape;
    DType dtype;
    std::string key;
    std::vector<char> bytes;
  };
  std::string layer_;
  mutable std::mutex mu_;
  std::vector<Held> chunks_;
  std::map<std::string, CheckpointObject> objects_;
  std::map<std::string, TensorPlacement> placements_;
};

// Every file a save into `dir` by a world of `ranks` ranks may replace or remove: the index, a file
// per rank, and the rank files of an earlier save there. A command registers them as its outputs
// (tools/lib/output_files.h's FileUses) before it writes anything.
std::vector<std::string> checkpointOutputs(const std::string& dir, int ranks);

// The index text `text` with its field index_fnv1a64 set to the checksum a load verifies
// (docs/checkpoints.md): FNV-1a 64 of its canonical content, the compact JSON, keys sorted, without
// that field. CheckpointWriter seals what it writes; tests and fuzzers seal the indexes they edit.
// Throws InvalidArgument, as a load would, when `text` is no JSON object a load parses.
std::string sealCheckpointIndex(const std::string& text);

// A checkpoint's index read and checked (its checksum first, then every field strictly) without
// reading any of its files: what a load sizes its work by (keys, global shapes, dtypes, the layer
// kind) before it reads them. It keeps the directory's read lock until a CheckpointReader made
// from it has checked the files and opened them, so that they are the ones the index names.
class CheckpointIndex {
 public:
  // Throws InvalidArgument naming the index and the expected and actual value on any mismatch.
  explicit CheckpointIndex(const std::string& dir);
  CheckpointIndex(CheckpointIndex&&) noexcept;
  ~CheckpointIndex();

  // Chunks as the index records them; CheckpointReader checks them against the files.
  const std::map<std::string, CheckpointKey>& keys() const { return keys_; }
  // The kind of layer the saving run recorded (tpsim run's --layer); "" when none was.
  const std::string& layer() const { return layer_; }
  const std::map<std::string, CheckpointObject>& objects() const { return objects_; }
  const CheckpointKey& key(const std::string& key) const;  // throws, naming the key, if absent
  // Every file a reader reads: the index, then each file the index names.
  const std::vector<std::string>& paths() const { return paths_; }
  // The stored bytes of the largest chunk, which a reader reads whole.
  std::uint64_t largestChunkBytes() const;
  // The most stored bytes a ChunkCache holds while boxes of at most `boxElements` go through a key in
  // the order of its leading axis (CheckpointReader::readBox): the chunks a box overlaps, at most
  // those that share a row with a chunk at either end of it, and those between, which the box spans;
  // at most the key's.
  std::uint64_t chunkCacheBytes(std::int64_t boxElements) const;
  // Throws InvalidArgument, naming the checkpoint, `holder` and the sizes, when the files exceed the
  // memory available: for what holds every tensor whole (consolidate).
  void checkFitsInMemory(const std::string& holder) const;

 private:
  friend class CheckpointReader;
  struct File {
    std::string name, path;
    int writer = 0;
    std::uint64_t size = 0, headerChecksum = 0;
  };
  std::string home_, indexPath_, layer_;  // home_: the directory's canonical path
  std::vector<std::string> paths_;
  std::vector<File> files_;  // in the index's order
  std::map<std::string, CheckpointKey> keys_;
  std::map<std::string, CheckpointObject> objects_;
  std::unique_ptr<tools::DirectoryReadLock> lock_;  // held until a reader has checked the files
};

// A checkpoint checked whole at construction: the index (CheckpointIndex), every file's header
// against it, every chunk's checksum, and that each key's chunks tile its saved and its logical
// tensor exactly once. It holds none of the data: the files stay open, and each read takes the
// chunks it needs from them, one whole chunk at a time, checked against its checksum again (a file
// changed since is refused; one replaced is still read as it was checked). Afterwards const and safe
// to share between rank threads.
class CheckpointReader {
 public:
  // Throws InvalidArgument naming the file and the expected and actual value on any mismatch.
  explicit CheckpointReader(const std::string& dir) : CheckpointReader(CheckpointIndex(dir)) {}
  // Reads the files `index` names, each only once its header agrees with the file's size, a chunk at
  // a time, each chunk only if it fits in the memory available.
  explicit CheckpointReader(CheckpointIndex index);

  const std::map<std::string, CheckpointKey>& keys() const { return index_.keys(); }
  const std::string& layer() const { return index_.layer(); }
  const std::map<std::string, CheckpointObject>& objects() const { return index_.objects(); }
  const CheckpointKey& key(const std::string& key) const { return index_.key(key); }

  // One rank's chunk `target` (its own topology's shapes, padding and dtype), assembled from every
  // saved chunk it overlaps, pad rows zero, converted to target.dtype (round to nearest even), and
  // written into `dst` (target's local shape, any backend) through compute. Throws InvalidArgument
  // naming the key and both values when the logical global shapes differ or a dtype conversion is
  // not between floating types.
  void load(const ShardedTensor& target, View dst, Compute& compute) const;
  // An `_extra_state` entry: present in the checkpoint with the same grid.
  void checkObject(const ShardedObject& target) const;
  // The whole logical tensor of `key` (no pad rows) in the saved dtype, row-major.
  std::vector<char> consolidated(const std::string& key) const;
  // The chunks of one key that the last box read overlapped, kept for the next: boxes read in order
  // through a tensor then read each chunk once. One caller's: not to share between threads.
  struct ChunkCache {
    std::string key;
    std::map<const CheckpointChunk*, std::vector<char>> chunks;
  };
  // The box of the same tensor at `begin` of extent `shape` (one per axis), row-major in the saved
  // dtype, into `out`: a part of consolidated(key) without the whole. Without a cache it reads every
  // chunk the box overlaps.
  void readBox(const std::string& key, const std::vector<std::int64_t>& begin, const std::vector<std::int64_t>& shape,
               char* out, ChunkCache* cache = nullptr) const;
  // Every file it reads: the index, then each file the index names.
  const std::vector<std::string>& paths() const { return index_.paths(); }

 private:
  CheckpointIndex index_;
  std::map<std::string, tools::InputFile> files_;   // file -> open since it was checked
  std::map<std::string, std::uint64_t> dataStart_;  // file -> the byte its data starts at
  // A chunk of `key` read whole (its data_offsets, checked against its file's header) and checked
  // against its checksum.
  std::vector<char> chunkData(const std::string& key, const CheckpointChunk& chunk) const;
};

}  // namespace tpsim
