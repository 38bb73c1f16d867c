// ModelParallelConfig: the fields of Megatron's model-parallel config the layers read (SPEC 1.6).
//
// Plain data plus validate(), which applies Megatron's config-time checks. Group objects are not
// here: a layer is handed the communicators it uses (core/process_groups.h builds them).
#pragma once

#include "backends/dtype.h"
#include "core/mxfp8.h"

namespace tpsim {

struct ModelParallelConfig {
  int tensorModelParallelSize = 1;  // T of the dense grid
  int expertTensorParallelSize = 0;  // ET; 0 = same as T
  int expertModelParallelSize = 1;  // E
  int gtpRematSize = 1;             // G (dense)
  int expertGtpRematSize = 1;       // EG
  int pipelineModelParallelSize = 1;
  bool sequenceParallel = false;
  bool useCpuInitialization = false;
  bool performInitialization = true;
  DType paramsDtype = DType::kFloat32;
  bool gradientAccumulationFusion = false;
  bool deferEmbeddingWgradCompute = false;
  int wgradDeferralLimit = 0;
  bool deterministicMode = false;
  // GTP_remat (SPEC 4.2, 4.5, 4.6). The wgrad reducer reads the last two through
  // GtpReduceOptions::fromConfig (core/gtp.h); the layers read the padding.
  int gtpPadForAlignment = 16;                 // a: pad dim 0 to a multiple of a·G; 0 = no padding
  bool calculatePerTokenLoss = false;          // false: the GTP wgrad reduce-scatter is a MEAN
  bool gtpReduceScatterWithFp32Accumulation = false;
  // How ColumnParallelLinear and RowParallelLinear hand their weight to the fprop and dgrad GEMMs
  // (Megatron: fp8_recipe = "mxfp8" with fp8_param). The embedding is a lookup, not a GEMM, and
  // always reads its table natively. mxfp8 with GTP_remat needs gtpPadForAlignment = 32·j.
  WeightFormat weightFormat = WeightFormat::kNative;

  int expertTp() const { return expertTensorParallelSize ? expertTensorParallelSize : tensorModelParallelSize; }
  // use_expert_pgs (SPEC 3.18 step 2): an expert layer's params are reduced over the expert
  // data-parallel topology (allreduce = false) when its expert grid differs from the dense one.
  bool useExpertPgs(bool isExpert) const {
    return isExpert && (expertModelParallelSize > 1 || expertTp() != tensorModelParallelSize ||
                        expertGtpRematSize != gtpRematSize);
  }
  // Megatron's config validation: SP needs T > 1; deferral needs PP > 1, fusion and a limit >= 0.
  void validate() const;
};

}  // namespace tpsim
