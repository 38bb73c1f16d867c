// Distributed-checkpoint metadata (SPEC 2.8, 3.17, 3.21, 4.8, 4.11): which chunk of which global
// tensor a rank holds, and whether this rank is the replica that writes it, with and without GTP_remat.
//
// Pure metadata: nothing here communicates, copies tensor values or writes a file; a group is only
// asked for its rank and size. There is no global TP, DP-CP or GTP replica group: every function
// takes the groups it reads, and a missing one is a clear error (SPEC 8 items 3, 14; 4.12). A
// GTP_remat shard gets the composite offsets of SPEC 4.11 and its writer is elected over the
// gtp-excluded replica group; checkReshardable says whether saved padded rows line up at load.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "backends/collectives.h"
#include "backends/view.h"
#include "core/embedding.h"
#include "core/grouped_linear.h"
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

// The dim-0 layout of a GTP_remat shard's weight (SPEC 4.2, 4.11.4): each rank's TP-local weight
// got padLength zero rows appended to its dim 0 before the GTP_remat split, so a tpAxis-0 weight
// with tpSize > 1 has pad rows after every TP slice. Megatron's ShardedTensor has no such record;
// tpsim keeps it so that a load can tell whether the saved rows line up (checkReshardable).
struct GtpPadding {
  int tpAxis = 0;              // the TP axis of the weight itself (prepended axes not counted)
  int tpSize = 1;              // T
  std::int64_t padLength = 0;  // pad rows per TP slice
};

// One rank's chunk of a global tensor (Megatron's ShardedTensor). The global axes are
// prependAxisNum prepended axes of local extent 1, then data's own axes; localShape is data's shape.
struct ShardedTensor {
  std::string key;
  ConstView data;  // the parameter's memory, not copied, unless `owned` holds the value saved
  std::shared_ptr<const Tensor> owned;  // a converted value (an MXFP8 weight's dequantized bf16)
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> localShape, globalShape, globalOffset;
  std::vector<int> axisFragmentations;  // chunks per global axis
  ReplicaId replicaId;
  int prependAxisNum = 0;
  // false: the global shape at load time must equal the saved one. True for the embedding and for a
  // padded GTP_remat shard.
  bool allowShapeMismatch = false;
  // GTP_remat shards only: how global axis prependAxisNum was padded (see "Padding and resharding").
  std::optional<GtpPadding> gtpPadding;

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

// gtp_replica_rank (SPEC 4.11.1): this rank's position among the ranks that hold the same GTP_remat
// shard, i.e. its rank in `group` when given, else in the param's stamped gtp_replica_group (the
// gtp-excluded DP-CP group, or expert DP for expert layers: LayerContext::gtpReplica). With neither
// it throws, naming gtp_replica_group: tpsim has no global group to fall back to (SPEC 4.12).
int gtpReplicaRank(const Parameter& param, Collectives* group = nullptr);

// make_tp_sharded_tensor_for_checkpoint (SPEC 2.8, 4.11.1). Let p = prependOffsets.size().
// - Plain tensor: offsets prependOffsets then (tpAxis + p, rank(tp), size(tp)); replicaId defaults
//   to (0, 0, rank(dpCp)), where dpCp must be the gtp-inclusive DP-CP group (SPEC 6 item 13).
// - GTP_remat shard (S, ...) of group size G, GTP rank g: with tpAxis 0 one composite offset
//   (p, t·G + g, T·G), so global axis p is T·G·S; otherwise (tpAxis + p, t, T) plus (p, g, G), so
//   global axis p is G·S. replicaId defaults to (0, 0, gtpReplicaRank(param, gtpReplicaGroup));
//   dpCp is not read. pad_length > 0 sets allowShapeMismatch (clear it afterwards to opt out); the
//   saved global shape is the padded one. gtpPadding records (tpAxis, T, pad_length).
ShardedTensor makeTpShardedTensorForCheckpoint(const Parameter& param, const std::string& key, int tpAxis,
                                               std::optional<ReplicaId> replicaId,
                                               const std::vector<RankOffset>& prependOffsets, Collectives& tp,
                                               Collectives& dpCp, Collectives* gtpReplicaGroup = nullptr);

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
// Without a GTP_remat shard among the entries that is all, and intraDpCpGroup is not read.
// With one, it is Megatron's make_sharded_tensors_for_checkpoint_with_gtp_remat (SPEC 4.11.2): with
// g, G the first shard's GTP rank and group size, t = rank(tp) and
// dpReplica = gtpReplicaRank(first shard, intraDpCpGroup),
//   GTP_remat shard (tpAxis from axisMap, else 0)   as makeTpShardedTensorForCheckpoint, replica
//                                                   (0, 0, gtpReplicaRank(shard)): no override
//   other entry in axisMap (column bias)            TP-sharded, replica (0, g, dpReplica)
//   other entry not in axisMap (row bias)           replicated, replica (0, t·G + g, dpReplica)
//   `_extra_state`                                  object, replica (0, t·G + g, dpReplica)
// so GTP peers never share a replica id, and dpCp is used for no replica id.
ShardedStateDict makeShardedTensorsForCheckpoint(const std::vector<StateDictEntry>& stateDict,
                                                 const std::string& prefix, const AxisMap& axisMap,
                                                 const std::vector<RankOffset>& shardedOffsets, Collectives& tp,
                                                 Collectives& dpCp, Collectives* intraDpCpGroup = nullptr);

// The layers' sharded_state_dict (SPEC 3.21, 4.11): weight (if allocated), bias (if any) and
// `_extra_state`, with axis maps {weight: 0, bias: 0} (column) and {weight: 1} (row), through
// makeShardedTensorsForCheckpoint, so a GTP_remat layer gets the replica ids of SPEC 4.11.2. tp must
// be the layer's TP group. dpCp is Megatron's metadata["dp_cp_group"], the gtp-inclusive DP-CP
// group: required even when the layer is GTP_remat-sharded and dpCp goes unused, nullptr is an error
// naming it. The layers are non-const only because their accessors are.
ShardedStateDict shardedStateDict(ColumnParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp);
ShardedStateDict shardedStateDict(RowParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp);
// The embedding's (SPEC 3.17, 4.9): one entry, prefix + "weight", TP-sharded on axis 0 (the
// composite offset under GTP_remat), always with allowShapeMismatch so that a checkpoint of a
// differently padded vocabulary loads.
ShardedStateDict shardedStateDict(VocabParallelEmbedding& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp);
// The routed experts' (Transformer Engine's grouped linear, SPEC 4.8, 4.11.5 item 8): for each local
// expert i in order, weight, bias (if any) and `_extra_state` under the keys prefix + "weight",
// "bias", "_extra_state", as the column (row) layer above would describe expert i's weight{i} and
// bias{i}, with one more prepended offset (p, e·E + i, EP·E) after the p = shardedOffsets.size()
// given ones: local expert i of EP rank e = rank(ep) is global expert e·E + i of EP·E, so every EP
// rank's experts form one global tensor (EP·E, ...) per key. An EGTP_remat shard gets the composite
// offsets and padded extent of SPEC 4.11.1 behind the expert axis. expertDp takes dp_cp_group's
// place in every replica id (Megatron's pg_collection.expt_dp): with EGTP_remat it must agree in
// rank and size with the weights' stamped gtp_replica_group, the gtp-excluded expert DP (the EGTP
// peers are told apart by the g folded into the non-shard ids); without, it must span the whole
// expert DP, as dpCp above. Throws InvalidArgument when expertDp is nullptr, when expertTp's rank or
// size differs from the layer's TP group, when ep (size > 1) is the layer's TP or EGTP_remat group,
// or when the stamped gtp_replica_group is the EGTP_remat group itself or disagrees with expertDp.
ShardedStateDict shardedStateDict(GroupedParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& expertTp,
                                  Collectives& ep, Collectives* expertDp);

// ---- Padding and resharding (SPEC 4.11.4, 8 item 26) ----------------------------------------------
//
// What is saved. A GTP_remat weight is saved with its padding: the pad rows are stored in the
// shards, are exact zeros, and are part of the global tensor. Let Dlog be the TP-local dim 0 and
// Dpad = Dlog + pad_length. Along global axis 0 (after the prepended axes):
// - tpAxis ≠ 0 (row), or T = 1: extent Dpad; logical row i sits at global row i, so the real rows
//   are [0, Dlog) and the pad rows the tail [Dlog, Dpad).
// - tpAxis 0 (column, embedding) with T > 1: extent T·Dpad; TP slice t was padded on its own, so
//   logical row i sits at global row t·Dpad + (i mod Dlog), t = i div Dlog. With pad_length > 0
//   the pad rows are interleaved, after every slice: N = 16, T = 2, G = 2, a = 16 gives Dlog 8,
//   pad 24, extent 64, real rows [0, 8) and [32, 40).
// Loading. DCP transfers the overlap of the saved and the target global extents (allowShapeMismatch
// lets them differ). If neither side interleaves pad rows, logical row i is global row i on both
// sides, so with the same Dlog every real row is transferred, saved pad rows land on target pad rows
// or are not read, and target pad rows past the saved extent keep the zeros of the wrap: they are
// recomputed, not loaded. (With a different Dlog, as for a resized vocabulary, the real rows past
// the shorter one meet pad rows or nothing: allowShapeMismatch's usual meaning.) Hence a padded
// T = 1 checkpoint and an unpadded one of any T load into every target with T = 1 or no padding,
// whatever its G. If either side interleaves (tpAxis 0, T > 1, pad_length > 0), global row i holds
// different logical rows on the two sides unless both have the same T, pad_length and global shape,
// which is then the only load checkReshardable accepts; Megatron would load misaligned rows.

// Throws InvalidArgument unless `target` may load what was saved as `saved`: the same key and global
// rank; the same global shape unless target.allowShapeMismatch; and rows that line up as above. G
// itself never matters: only T, pad_length and the extents fix where rows sit.
void checkReshardable(const ShardedTensor& saved, const ShardedTensor& target);

}  // namespace tpsim
