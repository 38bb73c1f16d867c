#include "core/checkpoint.h"

#include <algorithm>
#include <set>
#include <utility>

#include "backends/errors.h"
#include "core/mxfp8.h"

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

// The GTP_remat group wrapGtp stamped on a shard.
Collectives& gtpGroup(const char* where, const Parameter& shard) {
  TPSIM_CHECK(shard.attrs.group.has_value() && *shard.attrs.group != nullptr, where, ": GTP_remat shard '",
              shard.name, "' must carry its group (stamped by wrapGtp), got none");
  return **shard.attrs.group;
}

// Pad rows follow every TP slice of axis 0, not only the tail (SPEC 4.11.4).
bool interleavesPadding(const ShardedTensor& st) {
  return st.gtpPadding && st.gtpPadding->tpAxis == 0 && st.gtpPadding->tpSize > 1 && st.gtpPadding->padLength > 0;
}

std::string rowLayout(const ShardedTensor& st) {
  if (!st.gtpPadding) return detail::concat("no GTP_remat padding, global ", shapeText(st.globalShape));
  return detail::concat("tp_axis ", st.gtpPadding->tpAxis, ", T = ", st.gtpPadding->tpSize, ", pad_length ",
                        st.gtpPadding->padLength, ", global ", shapeText(st.globalShape));
}

void checkData(const char* where, const Parameter& param, const std::string& key) {
  TPSIM_CHECK(param.data.defined(), where, ": parameter '", param.name, "' for key '", key,
              "' must hold data, got an undefined tensor");
}

// The TP axis a parameter is sharded along, from its own tensor_model_parallel and partition_dim
// (what set_tensor_model_parallel_attributes stamped), or nullopt for a parameter TP replicates.
std::optional<int> tpAxisOf(const Parameter& param) {
  if (!param.attrs.tensorModelParallel.value_or(false)) return std::nullopt;
  return param.attrs.partitionDim.value_or(0);
}

// A layer's weight, bias and extra state with Megatron's axis map ({weight: 0, bias: 0} for a column
// layer, {weight: 1} for a row layer, SPEC 3.21), read off the parameters themselves.
ShardedStateDict layerStateDict(const char* where, const Parameter* weight, const Parameter* bias,
                                const std::string& prefix, const std::vector<RankOffset>& shardedOffsets,
                                Collectives& tp, Collectives* dpCp) {
  TPSIM_CHECK(dpCp != nullptr, where, ": metadata must provide dp_cp_group, got nullptr; pass the gtp-inclusive "
              "DP-CP group (there is no global group to fall back to)");
  // Module state-dict order: parameters as registered (absent ones omitted), then the extra state.
  std::vector<StateDictEntry> stateDict;
  AxisMap axisMap;
  for (const auto& [name, param] : {std::pair{"weight", weight}, {"bias", bias}}) {
    if (param == nullptr) continue;
    stateDict.push_back({name, param});
    if (const std::optional<int> axis = tpAxisOf(*param)) axisMap[name] = *axis;
  }
  stateDict.push_back({kExtraStateSuffix, nullptr});
  return makeShardedTensorsForCheckpoint(stateDict, prefix, axisMap, shardedOffsets, tp, *dpCp);
}

// An MXFP8 weight is saved as its dequantized bf16 value, the shard's shape and offsets unchanged
// (SPEC 4.11.1): the entry of `weight` then owns that copy.
void saveWeightAs(WeightFormat format, Compute& compute, const Parameter& weight, ShardedStateDict& sd) {
  if (format != WeightFormat::kMxfp8) return;
  for (ShardedEntry& entry : sd) {
    auto* t = std::get_if<ShardedTensor>(&entry);
    if (t == nullptr || t->data.data() != weight.data.data()) continue;
    t->owned = std::make_shared<const Tensor>(mxfp8CheckpointValue(compute, weight));
    t->data = *t->owned;
    t->dtype = t->data.dtype();
  }
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

int gtpReplicaRank(const Parameter& param, Collectives* group) {
  if (group != nullptr) return group->rank();
  TPSIM_CHECK(param.attrs.gtpReplicaGroup.has_value() && *param.attrs.gtpReplicaGroup != nullptr,
              "gtpReplicaRank: GTP_remat shard '", param.name,
              "' must carry a gtp_replica_group to elect its checkpoint writer, got none; build the layer with "
              "LayerContext::gtpReplica (the gtp-excluded DP-CP group, expert DP for expert layers) or pass the "
              "group explicitly (tpsim has no global group to fall back to)");
  return (*param.attrs.gtpReplicaGroup)->rank();
}

ShardedTensor makeTpShardedTensorForCheckpoint(const Parameter& param, const std::string& key, int tpAxis,
                                               std::optional<ReplicaId> replicaId,
                                               const std::vector<RankOffset>& prependOffsets, Collectives& tp,
                                               Collectives& dpCp, Collectives* gtpReplicaGroup) {
  const char* where = "makeTpShardedTensorForCheckpoint";
  checkData(where, param, key);
  TPSIM_CHECK(tpAxis >= 0 && tpAxis < param.data.shape().rank(), where, ": tpAxis for key '", key,
              "' must be an axis of ", param.data.str(), ", got ", tpAxis);
  const int p = int(prependOffsets.size());
  std::vector<RankOffset> offsets = prependOffsets;
  if (!isGtpShard(param)) {
    offsets.push_back({tpAxis + p, tp.rank(), tp.size()});
    return fromRankOffsets(key, param.data, offsets, replicaId.value_or(ReplicaId{0, 0, dpCp.rank()}), p);
  }
  // A shard (S, ...): rows [g·S, (g+1)·S) of TP slice t's padded weight (SPEC 4.11.1).
  Collectives& group = gtpGroup(where, param);
  const int g = group.rank(), G = group.size();
  if (tpAxis == 0) {
    offsets.push_back({p, std::int64_t(tp.rank()) * G + g, std::int64_t(tp.size()) * G});
  } else {
    offsets.push_back({tpAxis + p, tp.rank(), tp.size()});
    offsets.push_back({p, g, G});
  }
  ShardedTensor st = fromRankOffsets(
      key, param.data, offsets, replicaId ? *replicaId : ReplicaId{0, 0, gtpReplicaRank(param, gtpReplicaGroup)}, p);
  const std::int64_t pad = param.attrs.padLength.value_or(0);
  st.allowShapeMismatch = pad > 0;
  st.gtpPadding = GtpPadding{tpAxis, tp.size(), pad};
  return st;
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
                                                 Collectives& dpCp, Collectives* intraDpCpGroup) {
  const char* where = "makeShardedTensorsForCheckpoint";
  const Parameter* firstShard = nullptr;
  for (const StateDictEntry& e : stateDict) {
    if (endsWith(e.name, kExtraStateSuffix)) continue;
    TPSIM_CHECK(e.param != nullptr, where, ": state-dict entry '", e.name,
                "' must have a parameter (only *_extra_state entries may be None), got nullptr");
    if (firstShard == nullptr && isGtpShard(*e.param)) firstShard = e.param;
  }
  // The replica ids of the entries that are not GTP_remat shards: the vanilla defaults (nullopt)
  // without a shard, else SPEC 4.11.2's, with g folded in so that GTP peers never collide.
  std::optional<ReplicaId> shardedId, replicatedId;
  if (firstShard != nullptr) {
    Collectives& group = gtpGroup(where, *firstShard);
    const int g = group.rank(), G = group.size();
    const int dpReplica = gtpReplicaRank(*firstShard, intraDpCpGroup);
    shardedId = ReplicaId{0, g, dpReplica};
    replicatedId = ReplicaId{0, tp.rank() * G + g, dpReplica};
  }
  ShardedStateDict out;
  for (const StateDictEntry& e : stateDict) {
    const std::string key = prefix + e.name;
    if (endsWith(e.name, kExtraStateSuffix)) {
      out.emplace_back(makeShardedObjectForCheckpoint(key, shardedOffsets, replicatedId, tp, dpCp));
      continue;
    }
    const auto axis = axisMap.find(e.name);
    if (isGtpShard(*e.param))  // its own gtp_replica_rank: the override does not apply
      out.emplace_back(makeTpShardedTensorForCheckpoint(*e.param, key, axis != axisMap.end() ? axis->second : 0,
                                                        std::nullopt, shardedOffsets, tp, dpCp));
    else if (axis != axisMap.end())
      out.emplace_back(
          makeTpShardedTensorForCheckpoint(*e.param, key, axis->second, shardedId, shardedOffsets, tp, dpCp));
    else
      out.emplace_back(makeShardedTensorForCheckpoint(*e.param, key, replicatedId, shardedOffsets, tp, dpCp));
  }
  return out;
}

ShardedStateDict shardedStateDict(ColumnParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp) {
  ShardedStateDict sd = layerStateDict("shardedStateDict(ColumnParallelLinear)", layer.weight(), layer.bias(), prefix,
                                       shardedOffsets, tp, dpCp);
  if (layer.weight() != nullptr) saveWeightAs(layer.weightFormat(), layer.compute(), *layer.weight(), sd);
  return sd;
}

ShardedStateDict shardedStateDict(RowParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp) {
  ShardedStateDict sd = layerStateDict("shardedStateDict(RowParallelLinear)", &layer.weight(), layer.bias(), prefix,
                                       shardedOffsets, tp, dpCp);
  saveWeightAs(layer.weightFormat(), layer.compute(), layer.weight(), sd);
  return sd;
}

ShardedStateDict shardedStateDict(VocabParallelEmbedding& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& tp, Collectives* dpCp) {
  TPSIM_CHECK(dpCp != nullptr, "shardedStateDict(VocabParallelEmbedding): metadata must provide dp_cp_group, got "
              "nullptr; pass the gtp-inclusive DP-CP group (there is no global group to fall back to)");
  ShardedTensor weight = makeTpShardedTensorForCheckpoint(layer.weight(), prefix + "weight",
                                                          tpAxisOf(layer.weight()).value_or(0), std::nullopt,
                                                          shardedOffsets, tp, *dpCp);
  weight.allowShapeMismatch = true;
  return {weight};
}

ShardedStateDict shardedStateDict(GroupedParallelLinear& layer, const std::string& prefix,
                                  const std::vector<RankOffset>& shardedOffsets, Collectives& expertTp,
                                  Collectives& ep, Collectives* expertDp) {
  const char* where = "shardedStateDict(GroupedParallelLinear)";
  TPSIM_CHECK(expertDp != nullptr, where, ": expertDp must be the expert replicate-DP group (pg_collection.expt_dp), "
              "got nullptr (there is no global group to fall back to)");
  Collectives& tp = layer.tpGroup();
  // Only rank and size reach the metadata, so a group that agrees on both describes the same chunks.
  TPSIM_CHECK(expertTp.size() == tp.size() && expertTp.rank() == tp.rank(), where,
              ": expertTp must be the layer's expert TP group (size ", tp.size(), ", rank ", tp.rank(), "), got size ",
              expertTp.size(), ", rank ", expertTp.rank());
  const Parameter& w0 = layer.weight(0);
  Collectives* egtp = isGtpShard(w0) ? &gtpGroup(where, w0) : nullptr;
  TPSIM_CHECK(ep.size() == 1 || (&ep != &tp && &ep != egtp), where,
              ": ep must be the expert-parallel group, got the layer's ", &ep == &tp ? "expert TP" : "EGTP_remat",
              " group (size ", ep.size(), "); pass ProcessGroups::ep()");
  if (egtp != nullptr) {
    // The shards elect their writer in the stamped group, the other entries in expertDp (SPEC 4.11.2):
    // both must be Megatron's expert-DP replica rank, taken without the EGTP peers, which hold
    // different shards.
    TPSIM_CHECK(w0.attrs.gtpReplicaGroup.has_value() && *w0.attrs.gtpReplicaGroup != nullptr, where,
                ": GTP_remat shard '", w0.name, "' must carry a gtp_replica_group, got none; build the layer with "
                "LayerContext::gtpReplica = the gtp-excluded expert DP group");
    Collectives& stamped = **w0.attrs.gtpReplicaGroup;
    TPSIM_CHECK(&stamped != egtp, where, ": the gtp_replica_group stamped on '", w0.name,
                "' must be the gtp-excluded expert DP group, got its EGTP_remat group (size ", egtp->size(),
                "), over which only EGTP rank 0's shard would be written");
    TPSIM_CHECK(expertDp->size() == stamped.size() && expertDp->rank() == stamped.rank(), where,
                ": expertDp must be the gtp_replica_group stamped on '", w0.name,
                "', the gtp-excluded expert DP (size ", stamped.size(), ", rank ", stamped.rank(), "), got size ",
                expertDp->size(), ", rank ", expertDp->rank());
  }
  const int E = layer.numGemms();
  ShardedStateDict out;
  for (int i = 0; i < E; ++i) {
    std::vector<RankOffset> offsets = shardedOffsets;
    offsets.push_back({int(shardedOffsets.size()), std::int64_t(ep.rank()) * E + i, std::int64_t(ep.size()) * E});
    for (ShardedEntry& e : layerStateDict(where, &layer.weight(i), layer.bias(i), prefix, offsets, expertTp, expertDp))
      out.push_back(std::move(e));
  }
  return out;
}

void checkReshardable(const ShardedTensor& saved, const ShardedTensor& target) {
  const char* where = "checkReshardable";
  TPSIM_CHECK(target.key == saved.key, where, ": the target must have the saved key '", saved.key, "', got '",
              target.key, "'");
  TPSIM_CHECK(target.globalShape.size() == saved.globalShape.size(), where, ": key '", saved.key,
              "': the target global shape must have the saved rank ", saved.globalShape.size(), " (saved ",
              shapeText(saved.globalShape), "), got ", shapeText(target.globalShape));
  // Pad rows after every TP slice: row positions agree only for an identical layout (SPEC 8 item 26).
  const bool interleaved = interleavesPadding(saved) || interleavesPadding(target);
  const bool sameLayout = saved.gtpPadding && target.gtpPadding &&
                          target.gtpPadding->tpAxis == saved.gtpPadding->tpAxis &&
                          target.gtpPadding->tpSize == saved.gtpPadding->tpSize &&
                          target.gtpPadding->padLength == saved.gtpPadding->padLength &&
                          target.globalShape == saved.globalShape && target.prependAxisNum == saved.prependAxisNum;
  TPSIM_CHECK(!interleaved || sameLayout, where, ": key '", saved.key, "' pads each TP slice of axis 0 separately on ",
              interleavesPadding(saved) ? "the saved" : "the target",
              " side (tp_axis 0, T > 1, pad_length > 0), so it loads only with the same T, pad_length and global "
              "shape; saved ", rowLayout(saved), ", got target ", rowLayout(target),
              ", whose rows would not line up; only layouts with T = 1 or pad_for_alignment = 0 reshard freely");
  TPSIM_CHECK(target.allowShapeMismatch || target.globalShape == saved.globalShape, where, ": key '", saved.key,
              "': the target global shape must equal the saved ", shapeText(saved.globalShape),
              " unless the target allows a shape mismatch, got ", shapeText(target.globalShape));
}

}  // namespace tpsim
