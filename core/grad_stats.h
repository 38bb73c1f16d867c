// Gradient statistics that do not depend on the topology (SPEC 4.7): the finalize steps of
// sequence-parallel parameters (over TP) and of replicated parameters under GTP_remat, and the L2
// grad norm and zero count over a world, with
// Megatron's duplicate filters and padding corrections so that every (TP, GTP_remat, DP)
// factorization of one model and one batch reports the same numbers.
//
// These are the optimizer's view, not an optimizer: they read main_grad (or grad) and reduce over
// groups the caller passes. No global state. A rank either owns its parameters' whole gradients
// (plain DDP: reduce over the model-parallel group) or a distributed optimizer's fragments of them
// (reduce over the optimizer instance, ProcessGroups::intraDistOpt(): the whole world under
// GTP_remat, SPEC 4.7).
#pragma once

#include <cstdint>
#include <vector>

#include "backends/collectives.h"
#include "backends/compute.h"
#include "core/parameter.h"

namespace tpsim {

// finalize_model_grads for sequence-parallel params (SPEC 3.19 step 6): when `sequenceParallel`
// (the config's) is set, each trainable parameter tagged sequence_parallel has its main_grad (or
// grad) summed over TP. The tag decides, as in Megatron: RowParallelLinear's bias carries it because
// each rank's gradient covers only its own sequence slice.
void finalizeSequenceParallelGrads(const std::vector<Parameter*>& params, Collectives& tp, bool sequenceParallel);

// finalize_model_grads for replicated params under GTP_remat: each non-shard parameter's
// main_grad is all-reduced over its GTP group (the EGTP group for allreduce = false), averaged
// when `mean`, summed otherwise. GTP shards are skipped: their reduce-scatter already did this.
void finalizeReplicatedGrads(const std::vector<Parameter*>& params, Collectives* gtp, Collectives* egtp, bool mean);

// gtp_pad_zeros for a rank that owns its whole shard (Muon-style fragment [0, numel)).
void stampGtpPadZeros(const std::vector<Parameter*>& params);

// Which of this rank's parameters a statistic counts: not a TP duplicate (3.3) and not a GTP
// duplicate (3.5).
struct DuplicateFilter {
  Collectives* tp = nullptr;
  Collectives* expertTp = nullptr;
  Collectives* gtp = nullptr;
  Collectives* egtp = nullptr;
  bool includes(const Parameter& p) const;
};

// A flat range of one parameter's gradient that this rank's optimizer owns: an "optimizer-side
// param". gtpPadZeros is the padding inside the range (SPEC 3.6), which a zero count subtracts.
struct GradFragment {
  const Parameter* param = nullptr;
  std::int64_t begin = 0, end = 0;
  std::int64_t gtpPadZeros = 0;
};

// Each parameter whole, with the gtp_pad_zeros stamped on it (absent = 0).
std::vector<GradFragment> wholeGradients(const std::vector<Parameter*>& params);

// A distributed optimizer's share for data-parallel rank `dpRank` of `dpSize` (the replicate DP
// group the gradients were reduced over, gtp-excluded dp_cp under GTP_remat): the gradients laid
// end to end in `params` order, padded to a multiple of dpSize and cut into equal contiguous
// ranges, as Megatron's DistributedOptimizer cuts its grad buffer. Empty pieces are dropped.
std::vector<GradFragment> distOptFragments(const std::vector<Parameter*>& params, int dpRank, int dpSize);

// sqrt(Σ over ranks of `stats` Σ over fragments of included params ‖main_grad[begin, end)‖²),
// summed in fp64. `stats` must be the group whose fragments tile every gradient exactly once.
double gradNormL2(Compute& compute, const std::vector<GradFragment>& fragments, const DuplicateFilter& filter,
                  Collectives& stats);
// Σ over ranks of `stats` Σ over fragments of included params (length − nnz − gtpPadZeros).
std::int64_t countZeros(Compute& compute, const std::vector<GradFragment>& fragments,
                        const DuplicateFilter& filter, Collectives& stats);

// The same over whole parameters (wholeGradients).
double gradNormL2(Compute& compute, const std::vector<Parameter*>& params, const DuplicateFilter& filter,
                  Collectives& stats);
std::int64_t countZeros(Compute& compute, const std::vector<Parameter*>& params, const DuplicateFilter& filter,
                        Collectives& stats);

}  // namespace tpsim
