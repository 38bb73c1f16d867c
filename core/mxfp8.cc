#include "core/mxfp8.h"

#include <utility>

#include "backends/errors.h"
#include "core/gtp.h"

namespace tpsim {
namespace {

std::int64_t ceilDiv(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The scales of an (R, C) matrix quantized along `axis` (compute.h quantizeMxfp8).
Shape scaleShape(std::int64_t rows, std::int64_t cols, int axis) {
  return axis == 1 ? Shape{rows, ceilDiv(cols, kMxfp8BlockSize)} : Shape{ceilDiv(rows, kMxfp8BlockSize), cols};
}

}  // namespace

const char* weightFormatName(WeightFormat format) {
  switch (format) {
    case WeightFormat::kNative: return "native";
    case WeightFormat::kMxfp8: return "mxfp8";
  }
  return "unknown";
}

WeightFormat parseWeightFormat(const std::string& name) {
  for (WeightFormat f : {WeightFormat::kNative, WeightFormat::kMxfp8})
    if (name == weightFormatName(f)) return f;
  TPSIM_CHECK(false, "weight format must be native or mxfp8, got '", name, "'");
}

void checkMxfp8Alignment(WeightFormat format, int gtpSize, int padForAlignment, const char* where) {
  if (format != WeightFormat::kMxfp8 || gtpSize <= 1) return;
  TPSIM_CHECK(padForAlignment > 0 && padForAlignment % kMxfp8BlockSize == 0, where,
              ": pad_for_alignment (--pad-for-alignment) must be a positive multiple of ", kMxfp8BlockSize,
              " for mxfp8 weights under GTP_remat (size ", gtpSize, "), got ", padForAlignment,
              "; each shard must hold whole ", kMxfp8BlockSize, "-row MXFP8 blocks");
}

GemmWeight gemmWeight(Compute& compute, const Parameter& weight, WeightFormat format, GemmUse use,
                      DType computeDtype) {
  const bool gtp = isGtpShard(weight);
  GemmWeight out;
  if (format == WeightFormat::kNative) {
    if (!gtp) {
      out.weight = weight.data;
      return out;
    }
    Materialized m = materialize(compute, weight);
    out.storage = std::move(m.gathered);
    out.weight = m.weight;
    return out;
  }
  const ConstView local = weight.data;  // (S, K) shard, or (N, K)
  TPSIM_CHECK(local.rank() == 2, "gemmWeight: ", weight.name, " must be a matrix (N, K) for mxfp8, got ",
              local.str());
  const int axis = use == GemmUse::kFprop ? 1 : 0;
  const std::int64_t rows = local.dim(0), k = local.dim(1);
  Tensor data = compute.empty(local.shape(), DType::kFloat8E4M3);                     // (S, K)
  Tensor scales = compute.empty(scaleShape(rows, k, axis), DType::kFloat8E8M0);      // (S, K/32) or (S/32, K)
  compute.quantizeMxfp8(local, data, scales, axis);
  std::int64_t dLog = rows;
  if (gtp) {
    TPSIM_CHECK(weight.attrs.group.has_value() && *weight.attrs.group != nullptr, "gemmWeight: ", weight.name,
                " has no GTP_remat group");
    Collectives& group = **weight.attrs.group;
    TPSIM_CHECK(rows % kMxfp8BlockSize == 0, "gemmWeight: the GTP_remat shard ", weight.name,
                " must have a multiple of ", kMxfp8BlockSize, " rows for mxfp8, got ", rows,
                "; a columnwise block must not straddle two shards, set pad_for_alignment to a multiple of ",
                kMxfp8BlockSize);
    const int g = group.size();
    Tensor allData = compute.empty({rows * g, k}, DType::kFloat8E4M3);                  // (S·G, K)
    Tensor allScales = compute.empty(scaleShape(rows * g, k, axis), DType::kFloat8E8M0);
    auto dataReady = group.allGather(data, allData);        // E4M3 bytes in GTP-rank order
    auto scalesReady = group.allGather(scales, allScales);  // their scales, the same order
    dataReady->wait();
    scalesReady->wait();
    data = std::move(allData);
    scales = std::move(allScales);
    dLog = rows * g - weight.attrs.padLength.value_or(0);
  }
  const std::int64_t scaleRows = axis == 1 ? dLog : ceilDiv(dLog, kMxfp8BlockSize);
  auto dequantized = std::make_shared<Tensor>(compute.empty({dLog, k}, computeDtype));  // (dLog, K)
  compute.dequantizeMxfp8(data.view().slice(0, 0, dLog), scales.view().slice(0, 0, scaleRows), axis, *dequantized);
  out.weight = *dequantized;
  out.storage = std::move(dequantized);
  return out;
}

Tensor mxfp8CheckpointValue(Compute& compute, const Parameter& weight) {
  const ConstView local = weight.data;
  TPSIM_CHECK(local.rank() == 2, "mxfp8CheckpointValue: ", weight.name, " must be a matrix (N, K), got ",
              local.str());
  Tensor data = compute.empty(local.shape(), DType::kFloat8E4M3);
  Tensor scales = compute.empty(scaleShape(local.dim(0), local.dim(1), 1), DType::kFloat8E8M0);
  compute.quantizeMxfp8(local, data, scales, 1);
  Tensor out = compute.empty(local.shape(), DType::kBFloat16);
  compute.dequantizeMxfp8(data, scales, 1, out);
  return out;
}

}  // namespace tpsim
