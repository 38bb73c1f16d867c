#include "core/attributes.h"

#include <algorithm>

#include "backends/errors.h"

namespace tpsim {

void setTensorModelParallelAttributes(ParamAttributes& attrs, bool isParallel, int dim, int stride) {
  forEachModelParallelAttribute([&](const auto& row) {
    TPSIM_CHECK(!(attrs.*row.field).has_value(), "setTensorModelParallelAttributes: attribute '", row.name,
                "' must be absent, got it already set; the six model-parallel attributes can be set only "
                "once, and not after setDefaultsIfNotSetTensorModelParallelAttributes");
  });
  attrs.tensorModelParallel = isParallel;
  attrs.partitionDim = dim;
  attrs.partitionStride = stride;
}

void setDefaultsIfNotSetTensorModelParallelAttributes(ParamAttributes& attrs) {
  forEachModelParallelAttribute([&](const auto& row) {
    if (!(attrs.*row.field)) attrs.*row.field = row.defaultValue;
  });
}

void copyTensorModelParallelAttributes(ParamAttributes& destination, const ParamAttributes& source) {
  forEachModelParallelAttribute([&](const auto& row) {
    if (source.*row.field) destination.*row.field = source.*row.field;
  });
}

void copyGtpAttributes(ParamAttributes& destination, const ParamAttributes& source) {
  if (source.isGtpWeightRemat) destination.isGtpWeightRemat = source.isGtpWeightRemat;
  if (source.allreduce) destination.allreduce = source.allreduce;
  if (source.gtpReplicaGroup) destination.gtpReplicaGroup = source.gtpReplicaGroup;
  if (source.padLength) destination.padLength = source.padLength;
  if (source.group) destination.group = source.group;
}

bool paramIsNotTensorParallelDuplicate(const Parameter& param, Collectives* tpGroup,
                                       Collectives* expertTpGroup) {
  const ParamAttributes& a = param.attrs;
  if (a.tensorModelParallel.value_or(false)) return true;  // every TP rank holds a distinct shard
  Collectives* group = tpGroup;
  if (a.allreduce == false && expertTpGroup != nullptr) group = expertTpGroup;
  TPSIM_CHECK(group != nullptr, "paramIsNotTensorParallelDuplicate: tpGroup must be given for parameter '",
              param.name, "', which is not TP-sharded, got nullptr; there is no global TP group to fall back to");
  return group->rank() == 0;
}

bool paramIsNotGtpDuplicate(const Parameter& param, Collectives* gtpGroup, Collectives* egtpGroup) {
  const ParamAttributes& a = param.attrs;
  if (a.isGtpWeightRemat.value_or(false)) return true;  // every GTP peer holds a distinct shard
  Collectives* group = a.allreduce == false ? egtpGroup : gtpGroup;
  return group == nullptr || group->rank() == 0;
}

std::int64_t gtpLocalPadZeroCount(const Parameter& gtpShard, std::int64_t rangeStart, std::int64_t rangeEnd) {
  const std::int64_t p = gtpShard.attrs.padLength.value_or(0);
  Collectives* group = gtpShard.attrs.group.value_or(nullptr);
  TPSIM_CHECK(p >= 0, "gtpLocalPadZeroCount: padLength of '", gtpShard.name, "' must be >= 0, got ", p);
  if (p == 0 || group == nullptr) return 0;
  const Shape& shape = gtpShard.data.shape();
  TPSIM_CHECK(shape.rank() >= 1, "gtpLocalPadZeroCount: shard '", gtpShard.name,
              "' must be a tensor of rank >= 1, got shape ", shape.str());

  const std::int64_t s = shape[0];  // local rows, padding included
  if (s == 0) return 0;
  const std::int64_t n = shape.numel();
  const std::int64_t row = n / s;  // elements per row
  const std::int64_t g = group->rank();
  // Padding is the tail rows [S·G − p, S·G) of the padded buffer; this shard holds rows
  // [g·S, (g+1)·S), so its padding starts at local row L. Using the row offset (not "is the last
  // rank") also covers padding that spills into lower ranks.
  const std::int64_t padFirstRow = s * group->size() - p;
  const std::int64_t localPadRow = std::clamp(padFirstRow - g * s, std::int64_t(0), s);

  const std::int64_t begin = std::clamp(rangeStart, std::int64_t(0), n);
  const std::int64_t end = std::clamp(rangeEnd, std::int64_t(0), n);
  return std::max(std::int64_t(0), end - std::max(begin, localPadRow * row));
}

}  // namespace tpsim
