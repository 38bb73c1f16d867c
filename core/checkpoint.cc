#include "core/checkpoint.h"

#include <algorithm>
#include <set>
#include <utility>

#include "backends/errors.h"

namespace tpsim {
namespace {

const char kExtraStateSuffix[] = "_extra_state";

std::string str(const RankOffset& o) {
  return detail::concat("(axis ", o.axis, ", chunk ", o.chunkIndex, " of ", o.numChunks, ")");
}

// Megatron's CheckpointingException cases for one offset triple.
void checkRankOffset(const char* where, const std::string& key, const RankOffset& o) {
  TPSIM_CHECK(o.axis >= 0 && o.chunkIndex >= 0 && o.numChunks >= 1 && o.chunkIndex < o.numChunks, where,
              ": rank offset for key '", key,
              "' must have axis >= 0, numChunks >= 1 and 0 <= chunkIndex < numChunks, got ", str(o));
}

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void checkData(const char* where, const Parameter& param, const std::string& key) {
  TPSIM_CHECK(param.data.defined(), where, ": parameter '", param.name, "' for key '", key,
              "' must hold data, got an undefined tensor");
}

ShardedStateDict layerStateDict(const char* where, const Parameter* weight, const Parameter* bias,
                                const AxisMap& axisMap, const std::string& prefix,
                                const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp) {
  TPSIM_CHECK(dpCp != nullptr, where, ": metadata must provide dp_cp_group, got nullptr; pass the gtp-inclusive "
              "DP-CP group (there is no global group to fall back to)");
  // Module state-dict order: parameters as registered (absent ones omitted), then the extra state.
  std::vector<StateDictEntry> stateDict;
  if (weight != nullptr) stateDict.push_back({"weight", weight});
  if (bias != nullptr) stateDict.push_back({"bias", bias});
  stateDict.push_back({kExtraStateSuffix, nullptr});
  return makeShardedTensorsForCheckpoint(stateDict, prefix, axisMap, shardedOffsets, tp, *dpCp);
}

}  // namespace

bool isMainReplica(const ReplicaId& replicaId) {
  return std::all_of(replicaId.begin(), replicaId.end(), [](int r) { return r == 0; });
}

const std::string& shardedKey(const ShardedEntry& entry) {
  return std::visit([](const auto& e) -> const std::string& { return e.key; }, entry);
}

ShardedTensor fromRankOffsets(const std::string& key, ConstView data, const std::vector<RankOffset>& rankOffsets,
                              ReplicaId replicaId, int prependAxisNum) {
  const char* where = "fromRankOffsets";
  TPSIM_CHECK(prependAxisNum >= 0, where, ": prependAxisNum for key '", key, "' must be >= 0, got ", prependAxisNum);
  ShardedTensor st;
  st.key = key;
  st.data = data;
  st.dtype = data.dtype();
  for (int i = 0; i < data.rank(); ++i) st.localShape.push_back(data.dim(i));
  const int globalRank = prependAxisNum + data.rank();
  st.globalShape.assign(prependAxisNum, 1);
  st.globalShape.insert(st.globalShape.end(), st.localShape.begin(), st.localShape.end());
  st.globalOffset.assign(globalRank, 0);
  st.axisFragmentations.assign(globalRank, 1);
  st.replicaId = std::move(replicaId);
  st.prependAxisNum = prependAxisNum;

  std::set<int> seen;
  for (const RankOffset& o : rankOffsets) {
    checkRankOffset(where, key, o);
    TPSIM_CHECK(o.axis < globalRank, where, ": rank offset for key '", key, "' must name an axis in [0, ", globalRank,
                ") (", prependAxisNum, " prepended, then those of ", data.str(), "), got ", str(o));
    // Megatron lets a later triple overwrite an earlier one on the same axis; that is never meant.
    TPSIM_CHECK(seen.insert(o.axis).second, where, ": each axis may be sharded once for key '", key, "', got axis ",
                o.axis, " twice");
    const std::int64_t local = o.axis < prependAxisNum ? 1 : data.dim(o.axis - prependAxisNum);
    st.globalShape[o.axis] = o.numChunks * local;
    st.globalOffset[o.axis] = o.chunkIndex * local;
    st.axisFragmentations[o.axis] = int(o.numChunks);
  }
  return st;
}

ShardedTensor makeTpShardedTensorForCheckpoint(const Parameter& param, const std::string& key, int tpAxis,
                                               std::optional<ReplicaId> replicaId,
                                               const std::vector<RankOffset>& prependOffsets, Collectives& tp,
                                               Collectives& dpCp) {
  const char* where = "makeTpShardedTensorForCheckpoint";
  checkData(where, param, key);
  TPSIM_CHECK(!isGtpShard(param), where, ": parameter '", param.name,
              "' must not be a GTP_remat shard (its composite offsets, SPEC 4.11, are not implemented), "
              "got is_gtp_weight_remat = True");
  TPSIM_CHECK(tpAxis >= 0 && tpAxis < param.data.shape().rank(), where, ": tpAxis for key '", key,
              "' must be an axis of ", param.data.str(), ", got ", tpAxis);
  const int p = int(prependOffsets.size());
  std::vector<RankOffset> offsets = prependOffsets;
  offsets.push_back({tpAxis + p, tp.rank(), tp.size()});
  return fromRankOffsets(key, param.data, offsets, replicaId.value_or(ReplicaId{0, 0, dpCp.rank()}), p);
}

ShardedTensor makeShardedTensorForCheckpoint(const Parameter& param, const std::string& key,
                                             std::optional<ReplicaId> replicaId,
                                             const std::vector<RankOffset>& prependOffsets, Collectives& tp,
                                             Collectives& dpCp) {
  const char* where = "makeShardedTensorForCheckpoint";
  checkData(where, param, key);
  TPSIM_CHECK(!isGtpShard(param), where, ": parameter '", param.name,
              "' must not be a GTP_remat shard, got is_gtp_weight_remat = True; a shard is not replicated");
  return fromRankOffsets(key, param.data, prependOffsets, replicaId.value_or(ReplicaId{0, tp.rank(), dpCp.rank()}),
                         int(prependOffsets.size()));
}

ShardedObject makeShardedObjectForCheckpoint(const std::string& key, const std::vector<RankOffset>& shardedOffsets,
                                             std::optional<ReplicaId> replicaId, Collectives& tp, Collectives& dpCp) {
  const char* where = "makeShardedObjectForCheckpoint";
  ShardedObject so;
  so.key = key;
  so.replicaId = replicaId.value_or(ReplicaId{0, tp.rank(), dpCp.rank()});
  if (shardedOffsets.empty()) {
    so.globalShape = {1};
    so.globalOffset = {0};
    return so;
  }
  std::vector<RankOffset> sorted = shardedOffsets;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const RankOffset& a, const RankOffset& b) { return a.axis < b.axis; });
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    checkRankOffset(where, key, sorted[i]);
    // The object's grid has exactly the prepended axes, so they must be 0, 1, … without gaps.
    TPSIM_CHECK(sorted[i].axis == int(i), where, ": sharded offsets for key '", key, "' must cover axes 0..",
                sorted.size() - 1, " once each, got ", str(sorted[i]), " at sorted position ", i);
    so.globalShape.push_back(sorted[i].numChunks);
    so.globalOffset.push_back(sorted[i].chunkIndex);
  }
  return so;
}

ShardedStateDict makeShardedTensorsForCheckpoint(const std::vector<StateDictEntry>& stateDict,
                                                 const std::string& prefix, const AxisMap& axisMap,
                                                 const std::vector<RankOffset>& shardedOffsets, Collectives& tp,
                                                 Collectives& dpCp) {
  const char* where = "makeShardedTensorsForCheckpoint";
  ShardedStateDict out;
  for (const StateDictEntry& e : stateDict) {
    const std::string key = prefix + e.name;
    if (endsWith(e.name, kExtraStateSuffix)) {
      out.emplace_back(makeShardedObjectForCheckpoint(key, shardedOffsets, std::nullopt, tp, dpCp));
      continue;
    }
    TPSIM_CHECK(e.param != nullptr, where, ": state-dict entry '", e.name,
                "' must have a parameter (only *_extra_state entries may be None), got nullptr");
    TPSIM_CHECK(!isGtpShard(*e.param), where, ": entry '", e.name,
                "' must not be a GTP_remat shard (the GTP-aware helper of SPEC 4.11.2 is not implemented), "
                "got is_gtp_weight_remat = True");
    const auto axis = axisMap.find(e.name);
    if (axis != axisMap.end())
      out.emplace_back(
          makeTpShardedTensorForCheckpoint(*e.param, key, axis->second, std::nullopt, shardedOffsets, tp, dpCp));
    else
      out.emplace_back(makeShardedTensorForCheckpoint(*e.param, key, std::nullopt, shardedOffsets, tp, dpCp));
  }
  return out;
}

ShardedStateDict shardedStateDict(ColumnParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp) {
  return layerStateDict("shardedStateDict(ColumnParallelLinear)", layer.weight(), layer.bias(),
                        {{"weight", 0}, {"bias", 0}}, prefix, shardedOffsets, tp, dpCp);
}

ShardedStateDict shardedStateDict(RowParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp) {
  return layerStateDict("shardedStateDict(RowParallelLinear)", &layer.weight(), layer.bias(), {{"weight", 1}}, prefix,
                        shardedOffsets, tp, dpCp);
}

ShardedStateDict shardedStateDict(VocabParallelEmbedding& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp) {
  TPSIM_CHECK(dpCp != nullptr, "shardedStateDict(VocabParallelEmbedding): metadata must provide dp_cp_group, got "
              "nullptr; pass the gtp-inclusive DP-CP group (there is no global group to fall back to)");
  ShardedTensor weight =
      makeTpShardedTensorForCheckpoint(layer.weight(), prefix + "weight", 0, std::nullopt, shardedOffsets, tp, *dpCp);
  weight.allowShapeMismatch = true;
  return {weight};
}

}  // namespace tpsim
