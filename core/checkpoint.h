// Distributed-checkpoint metadata without GTP_remat (SPEC 2.8, 3.21): which chunk of which global
// tensor a rank holds, and whether this rank is the replica that writes it.
//
// Pure metadata: nothing here communicates, copies tensor values or writes a file; a group is only
// asked for its rank and size. There is no global TP or DP-CP group: every function takes the
// groups it reads, and a missing one is a clear error (SPEC 8 items 3, 14). GTP_remat shards
// (SPEC 4.11) are rejected rather than described with TP-only offsets.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "backends/collectives.h"
#include "backends/view.h"
#include "core/embedding.h"
#include "core/layers.h"
#include "core/parameter.h"

namespace tpsim {

// Megatron's replica_id, an int or a tuple; an int is a one-element vector.
using ReplicaId = std::vector<int>;

// The replica that writes a chunk: every element of its id is 0.
bool isMainReplica(const ReplicaId& replicaId);

// Chunk `chunkIndex` of `numChunks` equal chunks along global axis `axis` (Megatron's
// (axis, rank_offset, fragmentation) triple). Layer offsets such as (0, layer_idx, num_layers)
// are passed as "sharded_offsets" on the prepended axes.
struct RankOffset {
  int axis = 0;
  std::int64_t chunkIndex = 0;
  std::int64_t numChunks = 1;
};

// One rank's chunk of a global tensor (Megatron's ShardedTensor). The global axes are
// prependAxisNum prepended axes of local extent 1, then data's own axes; localShape is data's shape.
struct ShardedTensor {
  std::string key;
  ConstView data;  // the parameter's memory; not copied
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> localShape, globalShape, globalOffset;
  std::vector<int> axisFragmentations;  // chunks per global axis
  ReplicaId replicaId;
  int prependAxisNum = 0;
  // false: the global shape at load time must equal the saved one (the embedding sets it true).
  bool allowShapeMismatch = false;

  bool isMainReplica() const { return tpsim::isMainReplica(replicaId); }
};

// A non-tensor entry (Megatron's ShardedObject), here always `_extra_state` with value None: it
// occupies cell globalOffset of a grid of globalShape cells.
struct ShardedObject {
  std::string key;
  std::vector<std::int64_t> globalShape, globalOffset;
  ReplicaId replicaId;

  bool isMainReplica() const { return tpsim::isMainReplica(replicaId); }
};

using ShardedEntry = std::variant<ShardedTensor, ShardedObject>;
using ShardedStateDict = std::vector<ShardedEntry>;  // in state-dict order

const std::string& shardedKey(const ShardedEntry& entry);

// A module's state dict: its parameters in registration order, then `_extra_state` entries
// (names ending in "_extra_state", param nullptr: the layers' extra state is None).
struct StateDictEntry {
  std::string name;
  const Parameter* param = nullptr;
};
using AxisMap = std::map<std::string, int>;  // state-dict name -> TP axis

// ShardedTensor.from_rank_offsets (SPEC 2.8). The global rank is prependAxisNum + data.rank(); each
// offset sets globalShape[axis] = numChunks·local and globalOffset[axis] = chunkIndex·local, where
// local is 1 on a prepended axis. Throws InvalidArgument (Megatron's CheckpointingException) on
// axis < 0, chunkIndex < 0, numChunks < 1 or chunkIndex >= numChunks, and also on an axis beyond the
// global rank or one given twice (Megatron: IndexError, silent overwrite).
ShardedTensor fromRankOffsets(const std::string& key, ConstView data, const std::vector<RankOffset>& rankOffsets,
                              ReplicaId replicaId = {0}, int prependAxisNum = 0);

// make_tp_sharded_tensor_for_checkpoint (SPEC 2.8): offsets prependOffsets then
// (tpAxis + prependOffsets.size(), rank(tp), size(tp)); replicaId defaults to (0, 0, rank(dpCp)).
// dpCp must be the gtp-inclusive DP-CP group (SPEC 6 item 13). A GTP_remat shard is rejected.
ShardedTensor makeTpShardedTensorForCheckpoint(const Parameter& param, const std::string& key, int tpAxis,
                                               std::optional<ReplicaId> replicaId,
                                               const std::vector<RankOffset>& prependOffsets, Collectives& tp,
                                               Collectives& dpCp);

// make_sharded_tensor_for_checkpoint (SPEC 2.8): replicated over TP, only the prepended offsets;
// replicaId defaults to (0, rank(tp), rank(dpCp)). A GTP_remat shard is an error (Megatron asserts).
ShardedTensor makeShardedTensorForCheckpoint(const Parameter& param, const std::string& key,
                                             std::optional<ReplicaId> replicaId,
                                             const std::vector<RankOffset>& prependOffsets, Collectives& tp,
                                             Collectives& dpCp);

// make_sharded_object_for_checkpoint (SPEC 2.8): global shape and offset from shardedOffsets sorted
// by axis, whose axes must then be 0, 1, …; (1,) and (0,) without offsets. replicaId defaults to
// (0, rank(tp), rank(dpCp)).
ShardedObject makeShardedObjectForCheckpoint(const std::string& key, const std::vector<RankOffset>& shardedOffsets,
                                             std::optional<ReplicaId> replicaId, Collectives& tp, Collectives& dpCp);

// make_sharded_tensors_for_checkpoint (SPEC 2.8), keys prefix + name: `_extra_state` entries become
// ShardedObjects, names in axisMap TP-sharded tensors on that axis, the rest replicated tensors.
// Megatron delegates to a GTP-aware helper (SPEC 4.11.2) when an entry is a GTP_remat shard; that
// helper is not implemented, so such an entry is an error.
ShardedStateDict makeShardedTensorsForCheckpoint(const std::vector<StateDictEntry>& stateDict,
                                                 const std::string& prefix, const AxisMap& axisMap,
                                                 const std::vector<RankOffset>& shardedOffsets, Collectives& tp,
                                                 Collectives& dpCp);

// The layers' sharded_state_dict (SPEC 3.21): weight (if allocated), bias (if any) and
// `_extra_state`, with axis maps {weight: 0, bias: 0} (column) and {weight: 1} (row). tp must be the
// layer's TP group. dpCp is Megatron's metadata["dp_cp_group"]: required, nullptr is an error naming
// it. The layers are non-const only because their accessors are.
ShardedStateDict shardedStateDict(ColumnParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp);
ShardedStateDict shardedStateDict(RowParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp);
// The embedding's (SPEC 3.17): one entry, prefix + "weight", TP-sharded on axis 0, with
// allow_shape_mismatch so that a checkpoint of a differently padded vocabulary loads.
ShardedStateDict shardedStateDict(VocabParallelEmbedding& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp);

}  // namespace tpsim
