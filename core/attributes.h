// Megatron's parameter-attribute helpers (SPEC 3.2-3.9): tagging, defaulting and copying the
// model-parallel and GTP attributes, the TP and GTP duplicate filters, and the GTP pad count.
//
// Pure metadata and integer math: nothing here communicates or touches tensor values (a group is
// only asked for its rank and size). There is no global TP or GTP group; every function that needs
// one takes it as an argument. Attribute absence is std::nullopt (core/parameter.h).
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "backends/collectives.h"
#include "core/parameter.h"

namespace tpsim {

// One row of Megatron's _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS (SPEC 3.2).
template <typename T>
struct ModelParallelAttribute {
  const char* name;                         // Megatron's attribute name, for messages
  std::optional<T> ParamAttributes::*field;
  T defaultValue;
};

// SPEC 3.2 as data: the closed set of six model-parallel attributes, in Megatron's order.
inline const std::tuple<ModelParallelAttribute<bool>, ModelParallelAttribute<bool>,
                        ModelParallelAttribute<std::optional<std::vector<std::int64_t>>>,
                        ModelParallelAttribute<bool>, ModelParallelAttribute<int>,
                        ModelParallelAttribute<int>>
    kModelParallelAttributeDefaults{
        {"expert_tp", &ParamAttributes::expertTp, false},
        {"is_qkv", &ParamAttributes::isQkv, false},
        {"qkv_split_shapes", &ParamAttributes::qkvSplitShapes, std::nullopt},  // present-with-None
        {"tensor_model_parallel", &ParamAttributes::tensorModelParallel, false},
        {"partition_dim", &ParamAttributes::partitionDim, -1},
        {"partition_stride", &ParamAttributes::partitionStride, 1},
    };

// Calls fn(row) for each row of kModelParallelAttributeDefaults, in order.
template <typename Fn>
void forEachModelParallelAttribute(Fn&& fn) {
  std::apply([&](const auto&... row) { (fn(row), ...); }, kModelParallelAttributeDefaults);
}

// SPEC 3.7. Sets tensorModelParallel, partitionDim and partitionStride. Throws InvalidArgument,
// naming the first one, if any of the six model-parallel attributes is already present: Megatron
// checks all six but writes three, so a tensor cannot be re-tagged, nor tagged after
// setDefaultsIfNotSetTensorModelParallelAttributes or with isQkv set (SPEC 8 item 5). The check
// is kept because it is the specified behaviour. On error `attrs` is unchanged.
void setTensorModelParallelAttributes(ParamAttributes& attrs, bool isParallel, int dim, int stride);

// SPEC 3.8. Each of the six that is absent gets its default; present ones are untouched.
void setDefaultsIfNotSetTensorModelParallelAttributes(ParamAttributes& attrs);

// SPEC 3.9. Each of the six present on `source` is assigned on `destination`; absent ones are
// neither copied nor cleared, so applying it twice equals applying it once.
void copyTensorModelParallelAttributes(ParamAttributes& destination, const ParamAttributes& source);

// SPEC 3.4. Copies isGtpWeightRemat, allreduce, gtpReplicaGroup, padLength and group (all five;
// the snapshot omitted group, SPEC 8 item 21) where present on `source`. Never deletes; idempotent.
void copyGtpAttributes(ParamAttributes& destination, const ParamAttributes& source);

// SPEC 3.3: should this rank count `param` in a statistic that must see each value once across TP?
// True if the param is TP-sharded. Otherwise the group is expertTpGroup when allreduce == false
// and expertTpGroup is given, else tpGroup, and the answer is "its rank is 0". Megatron falls back
// to the global TP group when that group is None; there is none here, so a null tpGroup that is
// needed throws InvalidArgument.
bool paramIsNotTensorParallelDuplicate(const Parameter& param, Collectives* tpGroup,
                                       Collectives* expertTpGroup = nullptr);

// SPEC 3.5: should this rank count `param` once across the GTP_remat / EGTP_remat axis? True for a
// GTP shard; otherwise "rank 0 of egtpGroup" for an expert param (allreduce == false), else of
// gtpGroup. Megatron reads the global groups; here the caller passes the groups the owning module
// resolved (SPEC 8 item 23). A null group means GTP is off for that axis: size 1, rank 0.
bool paramIsNotGtpDuplicate(const Parameter& param, Collectives* gtpGroup, Collectives* egtpGroup);

// SPEC 3.6: how many elements of the flat fragment [rangeStart, rangeEnd) of this rank's GTP shard
// are alignment padding. 0 without padLength or group. The range is clamped to [0, numel]; an
// empty or inverted range, or a shard with 0 rows, gives 0.
std::int64_t gtpLocalPadZeroCount(const Parameter& gtpShard, std::int64_t rangeStart,
                                  std::int64_t rangeEnd);

}  // namespace tpsim
