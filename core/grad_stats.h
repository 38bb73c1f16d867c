// Gradient statistics that do not depend on the topology (SPEC 4.7): the finalize step of
// replicated parameters under GTP_remat, and the L2 grad norm and zero count over a world, with
// Megatron's duplicate filters and padding corrections so that every (TP, GTP_remat, DP)
// factorization of one model and one batch reports the same numbers.
//
// These are the optimizer's view, not an optimizer: they read main_grad (or grad) and reduce over
// groups the caller passes. No global state.
#pragma once

#include <cstdint>
#include <vector>

#include "backends/collectives.h"
#include "backends/compute.h"
#include "core/parameter.h"

namespace tpsim {

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

// sqrt(Σ over ranks of `stats` Σ over included params ‖main_grad‖²), summed in fp64. `stats` is
// the grad-stats group: the model-parallel group (tp-gtp_remat-pp) when every DP replica holds
// whole gradients; the whole world when a distributed optimizer splits them (Megatron under GTP).
double gradNormL2(Compute& compute, const std::vector<Parameter*>& params, const DuplicateFilter& filter,
                  Collectives& stats);

// Σ over ranks of `stats` Σ over included params (numel − nnz − gtp_pad_zeros).
std::int64_t countZeros(Compute& compute, const std::vector<Parameter*>& params, const DuplicateFilter& filter,
                        Collectives& stats);

}  // namespace tpsim
