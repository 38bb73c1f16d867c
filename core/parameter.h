// Parameter: one rank's shard of a weight or bias, its gradients and Megatron's metadata.
//
// Megatron hangs "attributes" on torch parameters and tests whether they exist; here every
// attribute is a std::optional, so "absent" and "present with its default" stay distinct
// (SPEC 1.5). Parameter owns its data and the gradient buffers the layers write: `grad` (what
// autograd would accumulate) and `mainGrad` (the DDP wrapper's accumulation buffer, allocated by
// the caller when gradient-accumulation fusion or GTP needs it). It is not an autograd node.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "backends/collectives.h"
#include "backends/tensor.h"

namespace tpsim {

struct Parameter;

// Megatron's closed set of model-parallel attributes (_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS, SPEC 3.2)
// plus the others the layers read (SPEC 1.5). nullopt = the attribute is absent.
struct ParamAttributes {
  // The six model-parallel attributes, in Megatron's order.
  std::optional<bool> expertTp;
  std::optional<bool> isQkv;
  // Present-with-None is a real state (its default), hence the nested optional.
  std::optional<std::optional<std::vector<std::int64_t>>> qkvSplitShapes;
  std::optional<bool> tensorModelParallel;
  std::optional<int> partitionDim;
  std::optional<int> partitionStride;

  std::optional<bool> allreduce;         // false: reduced over the expert data-parallel topology
  std::optional<bool> sequenceParallel;  // RowParallelLinear bias: finalize all-reduces its grad over TP
  std::optional<bool> gradAddedToMainGrad;
  std::optional<bool> zeroOutWgrad;

  // GTP_remat (SPEC 4.3); `group` and `gtpReplicaGroup` are non-owning.
  std::optional<bool> isGtpWeightRemat;
  std::optional<Collectives*> group;
  std::optional<int> padLength;
  std::optional<Collectives*> gtpReplicaGroup;
  std::optional<std::int64_t> gtpPadZeros;
  // Routed experts (SPEC 4.8): the expert index of a grouped linear's shard, and, on weight0 only,
  // every expert's shard in expert order: the batch gathered and reduce-scattered together.
  std::optional<int> expertIdx;
  std::optional<std::vector<Parameter*>> weightList;  // non-owning
};

struct Parameter {
  std::string name;
  Tensor data;       // this rank's shard
  Tensor grad;       // undefined until a backward produces one ("None")
  Tensor mainGrad;   // undefined unless the caller allocated it
  bool requiresGrad = true;
  ParamAttributes attrs;

  bool hasGrad() const { return grad.defined(); }
  bool hasMainGrad() const { return mainGrad.defined(); }
};

}  // namespace tpsim
