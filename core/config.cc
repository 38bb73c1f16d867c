#include "core/config.h"

#include "backends/errors.h"

namespace tpsim {

void ModelParallelConfig::validate() const {
  TPSIM_CHECK(tensorModelParallelSize >= 1, "ModelParallelConfig: tensor_model_parallel_size must be >= 1, got ",
              tensorModelParallelSize);
  TPSIM_CHECK(!sequenceParallel || tensorModelParallelSize > 1,
              "ModelParallelConfig: sequence_parallel needs tensor_model_parallel_size > 1, got ",
              tensorModelParallelSize);
  TPSIM_CHECK(wgradDeferralLimit >= 0, "ModelParallelConfig: wgrad_deferral_limit must be >= 0, got ",
              wgradDeferralLimit);
  TPSIM_CHECK(gtpPadForAlignment >= 0, "ModelParallelConfig: gtp pad_for_alignment must be >= 0, got ",
              gtpPadForAlignment);
  if (deferEmbeddingWgradCompute) {
    TPSIM_CHECK(pipelineModelParallelSize > 1, "ModelParallelConfig: defer_embedding_wgrad_compute needs "
                "pipeline_model_parallel_size > 1, got ", pipelineModelParallelSize);
    TPSIM_CHECK(gradientAccumulationFusion, "ModelParallelConfig: defer_embedding_wgrad_compute needs "
                "gradient_accumulation_fusion");
  }
}

}  // namespace tpsim
