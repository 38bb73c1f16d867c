#include "core/grad_stats.h"

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

std::vector<double> valuesOf(Compute& compute, ConstView v) {
  Tensor wide = compute.empty(v.shape(), DType::kFloat64);
  compute.copy(v, wide);
  std::vector<double> host(static_cast<std::size_t>(v.numel()));
  compute.download(wide, host.data());
  return host;
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

double gradNormL2(Compute& compute, const std::vector<Parameter*>& params, const DuplicateFilter& filter,
                  Collectives& stats) {
  double local = 0;
  for (const Parameter* p : params)
    if (filter.includes(*p))
      for (double v : valuesOf(compute, gradOf(*p))) local += v * v;
  return std::sqrt(sumOver(compute, stats, local, DType::kFloat64));
}

std::int64_t countZeros(Compute& compute, const std::vector<Parameter*>& params, const DuplicateFilter& filter,
                        Collectives& stats) {
  std::int64_t local = 0;
  for (const Parameter* p : params) {
    if (!filter.includes(*p)) continue;
    for (double v : valuesOf(compute, gradOf(*p))) local += v == 0.0;
    local -= p->attrs.gtpPadZeros.value_or(0);
  }
  return sumOver(compute, stats, local, DType::kInt64);
}

}  // namespace tpsim
