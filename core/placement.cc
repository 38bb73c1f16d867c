#include "core/placement.h"

#include <algorithm>

#include "backends/errors.h"
#include "core/gtp.h"

namespace tpsim {
namespace {

// A run of one dim of a rank's tensor: `size` elements from global index `global` (or pad rows),
// at offset `local` of the rank's tensor.
struct Piece {
  std::int64_t global = 0, size = 0, local = 0;
  bool pad = false;
};

// TP slices along dim d: T when TP cuts d, else 1. Each slice's pad rows follow its last row.
int slicesAlong(const TensorPlacement& p, int d) {
  return p.tp.kind == AxisKind::kShard && p.tp.dim == d ? p.tp.size : 1;
}

// Where TP slice t's pad rows start in layout coordinates.
std::int64_t padStart(const TensorPlacement& p, int t) {
  const int d = p.gtp.dim;
  if (slicesAlong(p, d) == 1) return p.shape[d];
  const std::int64_t T = p.tp.size, chunk = p.shape[d] / (T * p.tp.stride);
  return (t + std::int64_t(p.tp.stride - 1) * T + 1) * chunk + p.gtp.padLength * t;
}

void checkAxis(const TensorPlacement& p, const AxisPlacement& a, const char* axis) {
  TPSIM_CHECK(a.size >= 1, "placement of ", p.name, ": the ", axis, " size must be >= 1, got ", a.size);
  const bool gathered = a.kind == AxisKind::kReplicate && a.stride > 1;
  if (a.kind != AxisKind::kShard && !gathered) return;
  TPSIM_CHECK(a.dim >= 0 && a.dim < int(p.shape.size()), "placement of ", p.name, ": ", axis, " shards dim ", a.dim,
              " of a rank-", p.shape.size(), " tensor");
  TPSIM_CHECK(a.stride >= 1 && a.padLength >= 0, "placement of ", p.name, ": ", axis, " stride must be >= 1 and "
              "padLength >= 0, got ", a.stride, " and ", a.padLength);
}

}  // namespace

const char* axisKindName(AxisKind kind) {
  switch (kind) {
    case AxisKind::kReplicate: return "replicate";
    case AxisKind::kShard: return "shard";
    case AxisKind::kPartial: return "partial";
  }
  return "?";
}

std::string placementText(const TensorPlacement& p) {
  std::string s = "TP: ";
  switch (p.tp.kind) {
    case AxisKind::kShard:
      s += detail::concat("shard dim ", p.tp.dim, p.vocab ? " (vocabulary ranges)" : "");
      if (p.tp.stride > 1) s += detail::concat(", stride ", p.tp.stride, " (interleaved chunks)");
      break;
    case AxisKind::kReplicate:
      s += "replicated";
      if (p.tp.stride > 1) s += detail::concat(", gathered in rank order along dim ", p.tp.dim, " (stride ", p.tp.stride,
                                               ": interleaved chunks)");
      break;
    case AxisKind::kPartial: s += "partial sums, " + p.reduction; break;
  }
  if (p.gtp.size > 1) {
    s += "; GTP_remat: ";
    if (p.gtp.kind == AxisKind::kReplicate) s += "replicated";
    else if (p.gtp.kind == AxisKind::kPartial) s += "partial sums";
    else if (p.role == TensorRole::kParameter || p.gtpShard)
      s += detail::concat("shard dim 0 of the TP-local tensor, ", p.gtp.padLength, " pad rows per TP slice");
    else s += detail::concat("shard dim ", p.gtp.dim, " (the batch: peers are data parallel)");
  }
  return s;
}

std::string holdsText(const TensorPlacement& p, int t, int g) {
  std::string s;
  for (const Block& b : blocksOf(p, t, g)) {
    s += s.empty() ? "" : " + ";
    if (b.pad) {
      s += detail::concat("pad rows [", b.local[0], ", ", b.local[0] + b.layout[0].size(), ") of its ",
                          localShape(p, t, g)[0]);
      continue;
    }
    for (std::size_t d = 0; d < b.global.size(); ++d)
      s += detail::concat(d ? " x " : "", "[", b.global[d].begin, ", ", b.global[d].end, ")");
  }
  return s;
}

std::vector<std::int64_t> TensorPlacement::layoutShape() const {
  std::vector<std::int64_t> s = shape;
  if (gtp.kind == AxisKind::kShard) s[gtp.dim] += gtp.padLength * slicesAlong(*this, gtp.dim);
  return s;
}

bool TensorPlacement::countedOn(int t, int g) const {
  return (tensorModelParallel || t == 0) && (gtpShard || g == 0);
}

std::vector<Block> blocksOf(const TensorPlacement& p, int t, int g) {
  checkAxis(p, p.tp, "TP");
  checkAxis(p, p.gtp, "GTP_remat");
  TPSIM_CHECK(t >= 0 && t < p.tp.size && g >= 0 && g < p.gtp.size, "placement of ", p.name, ": rank (t=", t, ", g=",
              g, ") outside T=", p.tp.size, " x G=", p.gtp.size);
  const int rank = int(p.shape.size());
  std::vector<std::vector<Piece>> pieces(rank);
  for (int d = 0; d < rank; ++d) pieces[d] = {Piece{0, p.shape[d], 0}};
  const bool gathered = p.tp.kind == AxisKind::kReplicate && p.tp.stride > 1;
  if (p.tp.kind == AxisKind::kShard || gathered) {
    const int d = p.tp.dim;
    const std::int64_t T = p.tp.size, S = p.tp.stride;
    TPSIM_CHECK(p.shape[d] % (T * S) == 0, "placement of ", p.name, ": dim ", d, " (", p.shape[d],
                ") must be divisible by T x stride = ", T * S);
    const std::int64_t chunk = p.shape[d] / (T * S);
    pieces[d].clear();
    // A shard holds its own chunks; a gathered copy every rank's, rank after rank.
    for (std::int64_t from = gathered ? 0 : t; from < (gathered ? T : t + 1); ++from)
      for (std::int64_t j = 0; j < S; ++j)
        pieces[d].push_back({(from + j * T) * chunk, chunk, (gathered ? from * S : 0) * chunk + j * chunk});
  }
  if (p.gtp.kind == AxisKind::kShard) {
    const int d = p.gtp.dim;
    std::int64_t extent = 0;  // TP-local, logical
    for (const Piece& q : pieces[d]) extent += q.size;
    const std::int64_t padded = extent + p.gtp.padLength, G = p.gtp.size;
    TPSIM_CHECK(padded % G == 0, "placement of ", p.name, ": the TP-local dim ", d, " (", extent, ") plus ",
                p.gtp.padLength, " pad rows must be divisible by G = ", G);
    const std::int64_t rows = padded / G, lo = g * rows, hi = lo + rows;
    std::vector<Piece> mine;
    for (const Piece& q : pieces[d]) {
      const std::int64_t b = std::max(lo, q.local), e = std::min(hi, q.local + q.size);
      if (b < e) mine.push_back({q.global + (b - q.local), e - b, b - lo});
    }
    // Pad rows: `global` counts from the slice's first pad row.
    if (const std::int64_t padFrom = std::max(lo, extent); padFrom < hi)
      mine.push_back({padFrom - extent, hi - padFrom, padFrom - lo, true});
    pieces[d] = mine;
  }
  // Runs adjacent both globally and locally are one block (stride chunks at T = 1).
  for (auto& along : pieces) {
    std::vector<Piece> merged;
    for (const Piece& q : along) {
      if (!merged.empty() && !q.pad && !merged.back().pad && merged.back().global + merged.back().size == q.global &&
          merged.back().local + merged.back().size == q.local)
        merged.back().size += q.size;
      else
        merged.push_back(q);
    }
    along = merged;
  }
  std::vector<Block> out;
  std::vector<std::size_t> at(rank, 0);  // odometer over the pieces of each dim, last dim fastest
  while (true) {
    Block b;
    for (int d = 0; d < rank; ++d) {
      const Piece& q = pieces[d][at[d]];
      b.local.push_back(q.local);
      if (q.pad) {
        b.pad = true;
        b.global.push_back({0, 0});
        const std::int64_t start = padStart(p, t) + q.global;  // q.global: offset into the pad rows
        b.layout.push_back({start, start + q.size});
      } else {
        b.global.push_back({q.global, q.global + q.size});
        const std::int64_t start = d == p.gtp.dim ? layoutIndexOf(p, q.global) : q.global;
        b.layout.push_back({start, start + q.size});
      }
    }
    out.push_back(std::move(b));
    int d = rank - 1;
    while (d >= 0 && ++at[d] == pieces[d].size()) at[d--] = 0;
    if (d < 0) break;
  }
  return out;
}

// Chunk c of the dim belongs to TP slice c mod T and is that slice's last one when c >= (stride - 1)·T:
// the layout holds every earlier chunk in order, then each slice's last chunk followed by its pad rows.
std::int64_t layoutIndexOf(const TensorPlacement& p, std::int64_t i) {
  const std::int64_t pad = p.gtp.kind == AxisKind::kShard ? p.gtp.padLength : 0;
  if (pad == 0 || slicesAlong(p, p.gtp.dim) == 1) return i;
  const std::int64_t T = p.tp.size, chunk = p.shape[p.gtp.dim] / (T * p.tp.stride);
  const std::int64_t c = i / chunk, lastRound = std::int64_t(p.tp.stride - 1) * T;
  return i + pad * std::max<std::int64_t>(0, c - lastRound);
}

std::optional<std::int64_t> logicalIndexOf(const TensorPlacement& p, std::int64_t at) {
  const std::int64_t pad = p.gtp.kind == AxisKind::kShard ? p.gtp.padLength : 0;
  const std::int64_t extent = p.shape[p.gtp.dim];
  if (pad == 0 || slicesAlong(p, p.gtp.dim) == 1) return at < extent ? std::optional<std::int64_t>(at) : std::nullopt;
  const std::int64_t T = p.tp.size, chunk = extent / (T * p.tp.stride);
  const std::int64_t before = std::int64_t(p.tp.stride - 1) * T * chunk;  // the chunks no pad rows follow
  if (at < before) return at;
  const std::int64_t slice = (at - before) / (chunk + pad), row = (at - before) % (chunk + pad);
  if (row >= chunk) return std::nullopt;
  return before + slice * chunk + row;
}

std::vector<Holder> holdersOf(const TensorPlacement& p, const std::vector<std::int64_t>& at) {
  TPSIM_CHECK(at.size() == p.shape.size(), "holdersOf ", p.name, ": expected an index of rank ", p.shape.size(),
              ", got rank ", at.size());
  std::vector<Holder> out;
  for (int g = 0; g < p.gtp.size; ++g)
    for (int t = 0; t < p.tp.size; ++t)
      for (const Block& b : blocksOf(p, t, g)) {
        bool inside = true;
        for (std::size_t d = 0; d < at.size(); ++d) inside = inside && b.layout[d].begin <= at[d] && at[d] < b.layout[d].end;
        if (!inside) continue;
        Holder h{t, g, b.local, b.pad};
        for (std::size_t d = 0; d < at.size(); ++d) h.local[d] += at[d] - b.layout[d].begin;
        out.push_back(std::move(h));
      }
  return out;
}

std::vector<std::int64_t> localShape(const TensorPlacement& p, int t, int g) {
  std::vector<std::int64_t> s(p.shape.size(), 0);
  for (const Block& b : blocksOf(p, t, g))
    for (std::size_t d = 0; d < s.size(); ++d) s[d] = std::max(s[d], b.local[d] + b.layout[d].size());
  return s;
}

std::int64_t padZeroCount(const TensorPlacement& p, int t, int g) {
  std::int64_t n = 0;
  for (const Block& b : blocksOf(p, t, g)) {
    if (!b.pad) continue;
    std::int64_t elements = 1;
    for (const Range& r : b.layout) elements *= r.size();
    n += elements;
  }
  return n;
}

const TensorPlacement& placementNamed(const std::vector<TensorPlacement>& placements, const std::string& name) {
  for (const TensorPlacement& p : placements)
    if (p.name == name) return p;
  std::string known;
  for (const TensorPlacement& p : placements) known += (known.empty() ? "" : ", ") + p.name;
  throw InvalidArgument(detail::concat("placementNamed: expected one of ", known.empty() ? "no placements" : known,
                                       ", got '", name, "'"));
}

TensorPlacement withoutGtp(const TensorPlacement& placement) {
  TensorPlacement p = placement;
  p.gtp = {};
  p.gtpShard = false;
  return p;
}

TensorPlacement stackedPartials(const TensorPlacement& partial) {
  TPSIM_CHECK(partial.tp.kind == AxisKind::kPartial, "stackedPartials: ", partial.name, " must be partial over TP, got ",
              axisKindName(partial.tp.kind));
  TensorPlacement p = partial;
  p.shape.insert(p.shape.begin(), partial.tp.size);
  p.tp = {AxisKind::kShard, partial.tp.size, 0};
  p.reduction.clear();
  if (p.gtp.kind == AxisKind::kShard) ++p.gtp.dim;
  return p;
}

TensorPlacement parameterPlacement(const Parameter& param, const std::string& name, int tpSize, int gtpSize) {
  const ParamAttributes& a = param.attrs;
  TensorPlacement p;
  p.name = name;
  p.role = TensorRole::kParameter;
  const Shape& local = param.data.shape();
  for (int d = 0; d < local.rank(); ++d) p.shape.push_back(local[d]);
  p.tensorModelParallel = a.tensorModelParallel.value_or(false);
  p.gtpShard = isGtpShard(param);
  p.gtp.size = gtpSize;
  if (p.gtpShard) {
    const int G = (*a.group)->size();
    TPSIM_CHECK(G == gtpSize, "parameterPlacement: ", name, " is a GTP_remat shard of a group of size ", G,
                ", expected the layer's ", gtpSize);
    p.gtp.kind = AxisKind::kShard;
    p.gtp.dim = 0;  // GTP_remat always cuts dim 0 of the TP-local tensor (SPEC 4.2)
    p.gtp.padLength = a.padLength.value_or(0);
    p.shape[0] = local[0] * G - p.gtp.padLength;
  }
  p.tp.size = tpSize;
  if (p.tensorModelParallel) {
    const int dim = a.partitionDim.value_or(-1);
    TPSIM_CHECK(dim >= 0 && dim < int(p.shape.size()), "parameterPlacement: ", name,
                " is tensor_model_parallel with partition_dim ", dim, ", outside its rank ", p.shape.size());
    p.tp.kind = AxisKind::kShard;
    p.tp.dim = dim;
    p.tp.stride = a.partitionStride.value_or(1);
    p.shape[dim] *= tpSize;
  }
  return p;
}

namespace {

TensorPlacement activation(const std::string& name, TensorRole role, std::vector<std::int64_t> shape, AxisPlacement tp,
                           int batchDim, int G) {
  TensorPlacement p;
  p.name = name;
  p.role = role;
  p.shape = std::move(shape);
  p.tp = tp;
  p.gtp = {G > 1 ? AxisKind::kShard : AxisKind::kReplicate, G, batchDim};
  return p;
}

AxisPlacement shard(int T, int dim, int stride = 1) { return {AxisKind::kShard, T, dim, stride}; }
AxisPlacement replicate(int T) { return {AxisKind::kReplicate, T}; }
AxisPlacement partial(int T) { return {AxisKind::kPartial, T}; }

int gtpSizeOf(const Parameter* weight) {
  return weight && isGtpShard(*weight) ? (*weight->attrs.group)->size() : 1;
}

TensorPlacement withPartial(TensorPlacement p, const std::string& name, const std::string& reduction) {
  p.name = name;
  p.tp = partial(p.tp.size);
  p.reduction = reduction;
  return p;
}

// Each parameter, and after the activations its gradient (same placement: the shard's main_grad).
void addParams(std::vector<TensorPlacement>& out, const std::vector<TensorPlacement>& params, bool gradients) {
  for (TensorPlacement p : params) {
    if (gradients) {
      p.name += ".grad";
      p.role = TensorRole::kGradient;
    }
    out.push_back(std::move(p));
  }
}

}  // namespace

std::vector<TensorPlacement> layerPlacements(ColumnParallelLinear& layer, std::int64_t s, std::int64_t b,
                                             const std::string& prefix) {
  const ColumnParallelOptions& o = layer.options();
  const int T = int(layer.outputSize() / layer.outputSizePerPartition()), G = gtpSizeOf(layer.weight());
  const bool sp = layer.sequenceParallel();
  std::vector<TensorPlacement> params;
  if (layer.weight()) params.push_back(parameterPlacement(*layer.weight(), prefix + "weight", T, G));
  if (layer.bias()) params.push_back(parameterPlacement(*layer.bias(), prefix + "bias", T, G));
  const AxisPlacement inTp = sp ? shard(T, 0) : replicate(T);
  // gather_output concatenates the ranks' stride-chunk shards in rank order (SPEC 3.11).
  const AxisPlacement outTp = o.gatherOutput ? AxisPlacement{AxisKind::kReplicate, T, 2, o.stride} : shard(T, 2, o.stride);
  std::vector<TensorPlacement> out;
  out.push_back(activation(prefix + "input", TensorRole::kInput, {s, b, layer.inputSize()}, inTp, 1, G));
  addParams(out, params, false);
  out.push_back(activation(prefix + "output", TensorRole::kOutput, {s, b, layer.outputSize()}, outTp, 1, G));
  out.push_back(activation(prefix + "output.grad", TensorRole::kGradient, {s, b, layer.outputSize()}, outTp, 1, G));
  TensorPlacement dx = activation(prefix + "input.grad", TensorRole::kGradient, {s, b, layer.inputSize()}, inTp, 1, G);
  if (o.disableGradReduce) {  // the caller sums the partials, even the one of T = 1
    out.push_back(withPartial(dx, dx.name, "summed by the caller (disable_grad_reduce)"));
  } else {
    if (T > 1)
      out.push_back(withPartial(dx, prefix + "input.grad.partial", sp ? "reduce-scatter over TP" : "all-reduce over TP"));
    out.push_back(dx);
  }
  addParams(out, params, true);
  return out;
}

std::vector<TensorPlacement> layerPlacements(RowParallelLinear& layer, std::int64_t s, std::int64_t b,
                                             const std::string& prefix) {
  const RowParallelOptions& o = layer.options();
  const int T = int(layer.inputSize() / layer.inputSizePerPartition()), G = gtpSizeOf(&layer.weight());
  const bool sp = layer.sequenceParallel();
  std::vector<TensorPlacement> params{parameterPlacement(layer.weight(), prefix + "weight", T, G)};
  if (layer.bias()) params.push_back(parameterPlacement(*layer.bias(), prefix + "bias", T, G));
  // Without input_is_parallel the layer scatters the input itself, and gathers its gradient back.
  const AxisPlacement inTp = o.inputIsParallel ? shard(T, 2, o.stride) : replicate(T);
  const AxisPlacement outTp = sp ? shard(T, 0) : replicate(T);
  std::vector<TensorPlacement> out;
  out.push_back(activation(prefix + "input", TensorRole::kInput, {s, b, layer.inputSize()}, inTp, 1, G));
  addParams(out, params, false);
  TensorPlacement y = activation(prefix + "output", TensorRole::kOutput, {s, b, layer.outputSize()}, outTp, 1, G);
  if (T > 1) out.push_back(withPartial(y, prefix + "output.partial", sp ? "reduce-scatter over TP" : "all-reduce over TP"));
  out.push_back(y);
  out.push_back(activation(prefix + "output.grad", TensorRole::kGradient, {s, b, layer.outputSize()}, outTp, 1, G));
  out.push_back(activation(prefix + "input.grad", TensorRole::kGradient, {s, b, layer.inputSize()}, inTp, 1, G));
  addParams(out, params, true);
  return out;
}

std::vector<TensorPlacement> layerPlacements(VocabParallelEmbedding& layer, std::int64_t s, std::int64_t b,
                                             const std::string& prefix) {
  const int T = int(layer.numEmbeddings() / layer.numEmbeddingsPerPartition()), G = gtpSizeOf(&layer.weight());
  const bool rs = layer.options().reduceScatterEmbeddings;
  const std::int64_t h = layer.embeddingDim();
  std::vector<TensorPlacement> params{parameterPlacement(layer.weight(), prefix + "weight", T, G)};
  params[0].vocab = true;
  // Batch-first (b, s, h), or (s/T, b, h) through the sequence-parallel reduce-scatter.
  TensorPlacement y = rs ? activation(prefix + "output", TensorRole::kOutput, {s, b, h}, shard(T, 0), 1, G)
                         : activation(prefix + "output", TensorRole::kOutput, {b, s, h}, replicate(T), 0, G);
  std::vector<TensorPlacement> out;
  out.push_back(activation(prefix + "input", TensorRole::kInput, {b, s}, replicate(T), 0, G));
  addParams(out, params, false);
  if (T > 1)
    out.push_back(withPartial(y, prefix + "output.partial", rs ? "reduce-scatter over TP" : "all-reduce over TP"));
  out.push_back(y);
  TensorPlacement dy = y;
  dy.name += ".grad";
  dy.role = TensorRole::kGradient;
  out.push_back(dy);
  addParams(out, params, true);
  return out;
}

std::vector<TensorPlacement> layerPlacements(GroupedParallelLinear& layer, std::int64_t tokens,
                                             const std::string& prefix) {
  const bool column = layer.parallelMode() == GroupedParallelMode::kColumn;
  const int T = layer.tpGroup().size(), G = gtpSizeOf(&layer.weight(0));
  const std::int64_t K = layer.inputSizePerPartition() * (column ? 1 : T);
  const std::int64_t N = layer.outputSizePerPartition() * (column ? T : 1);
  std::vector<TensorPlacement> params;
  for (int i = 0; i < layer.numGemms(); ++i) {
    params.push_back(parameterPlacement(layer.weight(i), detail::concat(prefix, "weight", i), T, G));
    if (layer.bias(i)) params.push_back(parameterPlacement(*layer.bias(i), detail::concat(prefix, "bias", i), T, G));
  }
  const char* dispatcher = "summed over expert TP by the token dispatcher";
  // Column: the tokens whole, the features of y sharded. Row: x's features sharded, y partial.
  TensorPlacement x = activation(prefix + "input", TensorRole::kInput, {tokens, K}, column ? replicate(T) : shard(T, 1), 0, G);
  TensorPlacement y = activation(prefix + "output", TensorRole::kOutput, {tokens, N}, column ? shard(T, 1) : replicate(T), 0, G);
  TensorPlacement dy = y;
  dy.name += ".grad";
  dy.role = TensorRole::kGradient;
  TensorPlacement dx = x;
  dx.name += ".grad";
  dx.role = TensorRole::kGradient;
  if (T > 1 && !column) y = withPartial(y, y.name, dispatcher);
  if (T > 1 && column) dx = withPartial(dx, dx.name, dispatcher);
  std::vector<TensorPlacement> out{x};
  addParams(out, params, false);
  for (TensorPlacement* p : {&y, &dy, &dx}) out.push_back(*p);
  addParams(out, params, true);
  return out;
}

}  // namespace tpsim
