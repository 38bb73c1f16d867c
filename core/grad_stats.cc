#include "core/grad_stats.h"

#include <algorithm>
#include <cmath>

#include "backends/errors.h"
#include "core/attributes.h"
#include "core/gtp.h"

namespace tpsim {
namespace {

ConstView gradOf(const Parameter& p) {
  TPSIM_CHECK(p.hasMainGrad() || p.hasGrad(), "grad stats: ", p.name, " has neither main_grad nor grad");
  return p.hasMainGrad() ? ConstView(p.mainGrad) : ConstView(p.grad);
}

// The fragment's gradient elements, widened to double.
std::vector<double> valuesOf(Compute& compute, const GradFragment& f) {
  const ConstView g = gradOf(*f.param);
  TPSIM_CHECK(0 <= f.begin && f.begin <= f.end && f.end <= g.numel(), "grad stats: fragment [", f.begin, ", ",
              f.end, ") of ", f.param->name, " must lie in [0, ", g.numel(), "]");
  Tensor wide = compute.empty(g.shape(), DType::kFloat64);
  compute.copy(g, wide);
  std::vector<double> host(static_cast<std::size_t>(g.numel()));
  compute.download(wide, host.data());
  return std::vector<double>(host.begin() + f.begin, host.begin() + f.end);
}

template <typename T>
T sumOver(Compute& compute, Collectives& group, T local, DType dtype) {
  Tensor t = compute.empty({1}, dtype);
  compute.upload(&local, t);
  group.allReduce(t)->wait();
  T out;
  compute.download(t, &out);
  return out;
}

}  // namespace

void finalizeSequenceParallelGrads(const std::vector<Parameter*>& params, Collectives& tp, bool sequenceParallel) {
  if (!sequenceParallel || tp.size() == 1) return;
  for (Parameter* p : params) {
    if (!p->requiresGrad || !p->attrs.sequenceParallel.value_or(false)) continue;
    TPSIM_CHECK(p->hasMainGrad() || p->hasGrad(), "finalizeSequenceParallelGrads: ", p->name,
                " is tagged sequence_parallel but has neither main_grad nor grad");
    tp.allReduce(p->hasMainGrad() ? View(p->mainGrad) : View(p->grad))->wait();
  }
}

void finalizeReplicatedGrads(const std::vector<Parameter*>& params, Collectives* gtp, Collectives* egtp, bool mean) {
  for (Parameter* p : params) {
    if (isGtpShard(*p)) continue;
    Collectives* group = p->attrs.allreduce.value_or(true) ? gtp : egtp;
    if (group == nullptr || group->size() == 1) continue;
    View g = p->hasMainGrad() ? View(p->mainGrad) : View(p->grad);
    group->allReduce(g, AllReduceOptions{mean ? ReduceOp::kMean : ReduceOp::kSum})->wait();
  }
}

void stampGtpPadZeros(const std::vector<Parameter*>& params) {
  for (Parameter* p : params)
    if (isGtpShard(*p)) p->attrs.gtpPadZeros = gtpLocalPadZeroCount(*p, 0, p->data.numel());
}

bool DuplicateFilter::includes(const Parameter& p) const {
  return paramIsNotTensorParallelDuplicate(p, tp, expertTp) && paramIsNotGtpDuplicate(p, gtp, egtp);
}

std::vector<GradFragment> wholeGradients(const std::vector<Parameter*>& params) {
  std::vector<GradFragment> out;
  for (const Parameter* p : params) out.push_back({p, 0, gradOf(*p).numel(), p->attrs.gtpPadZeros.value_or(0)});
  return out;
}

std::vector<GradFragment> distOptFragments(const std::vector<Parameter*>& params, int dpRank, int dpSize) {
  TPSIM_CHECK(dpSize >= 1 && 0 <= dpRank && dpRank < dpSize, "distOptFragments: dpRank must be in [0, dpSize = ",
              dpSize, "), got ", dpRank);
  std::int64_t total = 0;
  for (const Parameter* p : params) total += gradOf(*p).numel();
  const std::int64_t share = (total + dpSize - 1) / dpSize;
  const std::int64_t mineBegin = dpRank * share, mineEnd = mineBegin + share;
  std::vector<GradFragment> out;
  std::int64_t offset = 0;  // where the parameter starts in the buffer
  for (const Parameter* p : params) {
    const std::int64_t n = gradOf(*p).numel();
    const std::int64_t begin = std::max(mineBegin, offset) - offset, end = std::min(mineEnd, offset + n) - offset;
    if (begin < end)
      out.push_back({p, begin, end, isGtpShard(*p) ? gtpLocalPadZeroCount(*p, begin, end) : 0});
    offset += n;
  }
  return out;
}

double gradNormL2(Compute& compute, const std::vector<GradFragment>& fragments, const DuplicateFilter& filter,
                  Collectives& stats) {
  double local = 0;
  for (const GradFragment& f : fragments)
    if (filter.includes(*f.param))
      for (double v : valuesOf(compute, f)) local += v * v;
  return std::sqrt(sumOver(compute, stats, local, DType::kFloat64));
}

std::int64_t countZeros(Compute& compute, const std::vector<GradFragment>& fragments,
                        const DuplicateFilter& filter, Collectives& stats) {
  std::int64_t local = 0;
  for (const GradFragment& f : fragments) {
    if (!filter.includes(*f.param)) continue;
    for (double v : valuesOf(compute, f)) local += v == 0.0;
    local -= f.gtpPadZeros;
  }
  return sumOver(compute, stats, local, DType::kInt64);
}

double gradNormL2(Compute& compute, const std::vector<Parameter*>& params, const DuplicateFilter& filter,
                  Collectives& stats) {
  return gradNormL2(compute, wholeGradients(params), filter, stats);
}

std::int64_t countZeros(Compute& compute, const std::vector<Parameter*>& params, const DuplicateFilter& filter,
                        Collectives& stats) {
  return countZeros(compute, wholeGradients(params), filter, stats);
}

}  // namespace tpsim
