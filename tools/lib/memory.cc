#include "tools/lib/memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "backends/errors.h"
#include "core/gtp.h"
#include "sim/upper_gemm_bf16.h"
#include "tools/lib/job.h"
#include "tpsim_config.h"

namespace tpsim::tools {
namespace {

double numel(const ShapeMap& shapes, const std::string& name) {
  auto it = shapes.find(name);
  if (it == shapes.end()) return 0;
  double n = 1;
  for (std::int64_t d : it->second) n *= double(d);
  return n;
}

// The first number in `file` ("max" and unreadable files: nullopt).
std::optional<double> readNumber(const std::string& file) {
  std::ifstream in(file);
  double v = 0;
  if (in >> v) return v;
  return std::nullopt;
}

}  // namespace

// The sum of what holds memory at the peak, in bytes (docs/memory.md has the measurements). With X,
// Y and W the input, output-gradient and parameter elements (Wp: with GTP_remat's pad rows), T ranks
// and G GTP_remat peers:
//   program    9.5 MiB + 48 KiB a rank (11.25 MiB + 48 KiB where the gpu backend is built): the
//              binary, its libraries, the threads' and fibers' stacks (measured on runs of a few KiB
//              of tensors)
//   inputs     the unsharded inputs in their dtypes (4 bytes an fp32 element, 8 a token id), held
//              through the run and the verification
//   checkpoint 0.6d·Wp (1.1d·Wp where no rank keeps its results), this process's share of it: the
//              buffers its ranks read a --load-checkpoint's chunks into (measured)
// then the largest of the run's working set, the verification's (the run hands what its ranks freed
// back to the system before it verifies) and, with a checkpoint, the parameters' shards with a
// chunk for each running rank (each reads its chunks whole as it loads), and the chunks that the
// pieces cut from it come from:
//   copies     cT(fX·X + fY·Y) + R(oX·fX·X + oY·fY·Y) (+ 3T·n) + 2.5d·T(fP − fY)Y, c =
//              LayerKind::runBytesPerActivation, (oX, oY) = LayerKind::runningBytesPerActivation
//              ((0, 0); the grouped experts', fitted) and R the threads, the ranks running at once
//              (13; the embedding's 4d where TP is on, 3.5d at T = 1, d the dtype's bytes), with f the
//              rank's share of the tensor and fP of the output it makes as a partial sum before a
//              reduce-scatter cuts it to fY
//              (LayerKind::rankShare; the G peers split the batch): each rank's input and
//              input.grad, grad_output and output as backend tensors (4 bytes an element),
//              input.grad and output as the run keeps them (4), and the holes that freed conversions
//              leave between them in the one heap (1, measured); in a sequence-parallel run a tensor
//              split along the sequence is also held whole, about twice (8 bytes an element): the
//              one gathered copy its group shares, or a reduce-scatter's sum and the ranks'
//              partials not yet added to it (backends/collectives.h, allGatherShared and
//              reduceScatterConsuming), whatever the number of ranks
//   shards     (r + 4m)Wp + tWg: r = LayerKind::runBytesPerParameter, 14 for the linear kinds: each
//              parameter's shard and gradient as backend tensors and the gradient as the run keeps
//              it (4 bytes each), the shard while it is cut (2, measured; the column's and row's
//              max(2, 4.5P/T) without GTP_remat, P the threads, each cutting one rank's); the embedding's
//              (2 + G')d + 8P/(TG), d its dtype's bytes, G' = G under GTP_remat (else 0), P the
//              threads (its backend gradient is a scatter-add that touches few rows),
//              main_grad (m: 1 under --grad-accumulation-fusion or GTP_remat), and under GTP_remat
//              t bytes an element of Wg, the largest weight it shards (as held; where the kind
//              batches them all, LayerKind::gtpBatchedBytes an element of all of them): the gathered weight
//              its group shares and the peers' whole TP-local wgrads, which the reduce-scatter of one
//              weight at a time frees as it adds them up (measured where the weight is the run):
//              t = 7 + 6/T on one thread, where the peak is the same from run to run, and
//              7.5 + 3 min(G, 5, 6/T) on more, where it varies with how many peers wait at the
//              reduce-scatter with theirs held (at T = 1 it grows with G, from T = 2 it stops at
//              G = 3), as far down as the one thread's on a loaded machine
//   step       8S: the kind's other per-rank intermediates (LayerKind::stepIntermediates, in doubles)
//   packing    per thread that runs ranks (none for the embedding, which multiplies nothing), the
//              gemms' packed operands (sim/gemm_driver.h), each at
//              most 32 MiB: 8 bytes an element of the rank's largest left operand (its input or
//              output, as gathered, or its (tokens, F/T) intermediate) and of its largest right one
//              (its input or intermediate), or 4 of its weight as gathered if that is more (one
//              expert's: LayerKind::gemmWeightShare); measured
// or
//   kept       d·T(fX·X + fY·Y) + g·Wp: the results as the ranks left them, which verify reads in
//              place, d bytes an element of the run's dtype and g of the wgrads' (main_grad's under
//              --grad-accumulation-fusion)
//   reference  a(X + Y) + pW + 16 min(2^20, max(X, Y, W)) + 8R (+ 4 min(2^23, max(X, Y, W))): the
//              input and grad_output in double, the dense results sent whole, their bounds and the
//              magnitudes behind them (a: LayerKind::referenceBytesPerActivation, measured); the
//              parameters' part p (LayerKind::referenceBytesPerParameter); the rows verify reads at a
//              time; what the kind's reference holds at once besides
//              (LayerKind::referenceIntermediates, in doubles); on cores without AVX512-BF16, the
//              bounds' products (the embedding has none) pack their two operands as floats, 2 bytes
//              an element more than bf16 pairs (a and p were measured with bf16), at most 32 MiB more
//              (measured)
// and 5% of all that, at most 16 MiB: freed blocks the heap's arenas keep resident, between live ones
// and below their trim thresholds (measured).
// A process of a spread world verifying its part (RunScope::part) holds the inputs but the
// parameters whole and its share of these, keeps its share of the parameters' results (the first
// also every rank's other results, gathered), and its reference counts its share of the
// parameters, its blocks at most its rows, and the sums over the split dimension it sends or
// receives, one vector at a time (16 bytes an element of the larger activation).
double estimateRunBytes(const RunConfig& c, const ShapeMap& shapes, VerifyMode verify, const RunScope& scope) {
  const double T = c.tp, G = c.gtpRemat;
  // This process's ranks, and their share of the world's.
  const double P = scope.processes, here = T * G / P, fraction = 1 / P;
  const double x = numel(shapes, "input"), y = numel(shapes, "grad_output");
  // W as the run's tensors hold it, and as the ranks hold it: GTP_remat pads the TP-local rows of
  // each weight it shards, in every copy the ranks make.
  // largestGtp: the largest of the weights GTP_remat shards, as held; their reduce-scatters run one
  // weight at a time.
  double w = 0, held = 0, largestGtp = 0, allGtp = 0;
  for (const TensorSpec& t : c.layer->tensors(c)) {
    if (t.role != TensorRole::kParameter) continue;
    const double n = numel(shapes, t.name);
    w += n;
    const GtpWeightSpec* gtp = c.gtpRemat > 1 ? gtpWeightOf(c, t.name) : nullptr;
    const auto shape = shapes.find(t.name);
    double padded = n;
    if (gtp != nullptr && c.padForAlignment != 0 && shape != shapes.end() && !shape->second.empty() &&
        shape->second[0] >= 1) {
      const std::int64_t slices = gtp->tpCutsDim0 ? c.tp : 1, rows = shape->second[0];
      const double padRows =
          double(slices) * double(gtpRematShardDim0(rows / slices, c.gtpRemat, c.padForAlignment).padLength);
      padded += padRows * (n / double(rows));
    }
    held += padded;
    if (gtp != nullptr) largestGtp = std::max(largestGtp, padded), allGtp += padded;
  }
  // The CUDA runtime and NCCL, where the build links them, hold 1.75 MiB more from the start; Open
  // MPI's libraries and their threads, in a process of a job of several, 10 MiB (measured on a
  // tiny run), and 10 MiB of what the spread runs of docs/distributed.md held beyond their terms.
  const double program =
      ((TPSIM_HAVE_GPU ? 11.25 : 9.5) + (P > 1 ? 20 : 0)) * (1 << 20) + 48.0 * 1024 * here;
  const LayerKind::RankShare share = c.layer->rankShare(c);
  double inputs = 0, largestNumel = 0, inputShards = 0, parameterBytes = 0;
  for (const TensorSpec& t : c.layer->tensors(c)) {
    const double bytes = double(dtypeSize(t.idRange.empty() ? c.dtype : DType::kInt64)) * numel(shapes, t.name);
    inputs += bytes;
    if (t.role == TensorRole::kParameter) parameterBytes += bytes;
    largestNumel = std::max(largestNumel, numel(shapes, t.name));
    // A process that does not hold them whole keeps its ranks' shards, at T shares for the activations.
    const double shards = t.role == TensorRole::kParameter ? bytes
                          : t.name == "input"              ? T * share.input * bytes
                                                            : T * share.output * bytes;
    inputShards += fraction * shards;
  }
  const bool sequenceSplit = c.sequenceParallel || c.reduceScatterEmbeddings;
  // The elements of tensor n that a rank's gemms see (a split along the sequence is gathered whole),
  // and what the run holds whole of a tensor split along the sequence.
  auto seen = [&](double f, double n) { return (f < 1 && sequenceSplit ? n : f * n) / G; };
  auto heldWhole = [&](double f, double n) { return f < 1 && sequenceSplit ? n : 0; };
  // Each TP group with ranks in this process holds its own gathered copy, of its peers' batch.
  const double groupsHere = std::min(G, std::max(1.0, std::ceil(here / T)));
  const double whole = (heldWhole(share.input, x) + heldWhole(share.output, y)) * groupsHere / G;
  const double activationBytes = double(dtypeSize(c.dtype));
  // a rank's partial output, which a reduce-scatter cuts to its share: 2.5 elements of the dtype
  // (measured on the embedding at T = 2-8)
  const double partial = 2.5 * activationBytes * T * std::max(0.0, share.partialOutput - share.output) * y;
  const bool mainGrad = c.gradAccumulationFusion || c.gtpRemat > 1;
  const double threads = std::min(here, c.threads > 0 ? double(c.threads)
                                                      : std::max(1.0, double(std::thread::hardware_concurrency())));
  const double running = threads;
  const LayerKind::RunningBytes runningBytes = c.layer->runningBytesPerActivation(c);
  const double copies = fraction * (c.layer->runBytesPerActivation(c) * T * (share.input * x + share.output * y) +
                                    partial) +
                        running * (runningBytes.input * share.input * x + runningBytes.output * share.output * y) +
                        8 * whole;
  // On one thread the peers reach the reduce-scatter one after another; on more, how many wait
  // there with their wgrads held depends on the schedule, and the term covers the most measured.
  const double gtpBytes = threads == 1 ? 7 + 6 / T : 7.5 + 3 * std::min({G, 5.0, 6 / T});
  const std::optional<double> gtpBatched = c.layer->gtpBatchedBytes(c);
  // Per TP rank, one gathered weight and each peer's whole wgrad: a process holds those of its own
  // TP ranks and peers.
  const double peersHere = std::max(1.0, here / T);
  const double gtpTransient = G == 1 ? 0
                              : (gtpBatched ? *gtpBatched * allGtp : gtpBytes * largestGtp) *
                                    (1 + peersHere) / (1 + G);
  // The kinds' bytes a parameter grow with the threads, each cutting a rank's shard: this process's
  // threads cut its ranks', the fraction of the whole that P times as many threads would.
  const double shards =
      fraction * (c.layer->runBytesPerParameter(c, threads * P) + (mainGrad ? 4 : 0)) * held + gtpTransient;
  const double step = fraction * 8 * c.layer->stepIntermediates(c, shapes);
  const double hidden = c.layer->stepIntermediates(c, shapes) / 2 / (T * G);
  const double xs = seen(share.input, x), ys = seen(share.output, y);
  const double packedLimit = 32.0 * (1 << 20);
  const double packedWeight = 4 * held * c.layer->gemmWeightShare(c) / T;
  const double packing = !c.layer->packsOperands()
                             ? 0
                             : threads * (std::min(8 * std::max({xs, ys, hidden}), packedLimit) +
                                          std::min(std::max({packedWeight, 8 * xs, 8 * hidden}), packedLimit));
  // A collective of a group that spans processes moves every member's input to every process of
  // the group, which holds them all and the result (docs/distributed.md): a TP group's largest is
  // of an activation the ranks hold whole (an all-reduce), or gather or reduce-scatter whole (T
  // inputs of its peers' batch), a GTP_remat group's of its weights (G shards, or G whole TP-local
  // wgrads, of each TP rank here).
  auto reducedWhole = [&](double f, double n) { return f >= 1 || sequenceSplit ? n : 0; };
  const double tpExchange =
      P > 1 && here < T
          ? (T + 1) * activationBytes *
                std::max({reducedWhole(share.input, x), reducedWhole(share.output, y), share.partialOutput * y}) / G
          : 0;
  const double gtpExchange =
      P > 1 && G > 1 ? (G + 1) * double(dtypeSize(c.layer->gtpWireDtype(c))) * allGtp / T * std::min(T, here) : 0;
  // input.grad is (T, s, b, K): kept, and in the reference
  const double stacked = c.disableGradReduce ? 24 * T * x : 0;
  const double gradBytes = double(dtypeSize(c.gradAccumulationFusion ? c.mainGradDtype : c.dtype));
  const double kept = activationBytes * T * (share.input * x + share.output * y) + gradBytes * held;
  const double floatMagnitudePacking = sim::upperGemmBf16Runs() || !c.layer->packsOperands()
                                           ? 0
                                           : 4 * std::min(double(1 << 23), std::max({x, y, w}));
  const bool verifies = verify != VerifyMode::kNone && (scope.whole || scope.part);
  // Verifying its part, a process holds the inputs but the parameters whole, its part of these, and
  // the results of its ranks' rows; the first also every rank's other results, gathered. The sums
  // over the split dimension go to the first one vector at a time, as it asks: as sent, received and
  // taken (16 bytes an element of the larger activation, the MLP's output or input.grad, a column's
  // input.grad, a row's output, in each).
  const double keptActivations = activationBytes * T * (share.input * x + share.output * y);
  const double partInputs = scope.part ? inputs - parameterBytes + fraction * parameterBytes : 0;
  const double partKept = fraction * gradBytes * held + (scope.first ? keptActivations : 0);
  const double partGathered = scope.part && scope.first && P > 1 ? keptActivations * (2 - fraction) : 0;
  const double sumsReceived = scope.part && P > 1 ? 16 * std::max(x, y) : 0;
  const double parameters = scope.part ? fraction * w : w;
  const double reference = !verifies ? 0
                                     : (scope.part ? partKept + sumsReceived : kept) +
                                           c.layer->referenceBytesPerActivation(c) * (x + y) +
                                           c.layer->referenceBytesPerParameter(c) * parameters +
                                           16 * std::min(double(1 << 20), std::max({x, y, parameters})) +
                                           8 * c.layer->referenceIntermediates(c, shapes, scope.part ? fraction : 1) +
                                           floatMagnitudePacking;
  // Process 0 of a job gathers the other processes' results, each process's as one message it then
  // unpacks.
  const double gathered = P > 1 && scope.whole ? kept * (2 - fraction) : 0;
  // The results as the ranks keep them are part of the copies and shards terms; the ranks of a
  // spread world whose results nothing reads keep none (runSharded, KeptResults::kNone). Under
  // GTP_remat the peak is the wgrads' reduce-scatter, before any rank keeps a result.
  const bool resultsKept = scope.resultsRead || P == 1;
  const double unkept = resultsKept || G > 1 ? 0 : fraction * kept;
  const double run = copies + shards + step + packing + tpExchange + gtpExchange - unkept;
  // A process that keeps its ranks' shards cuts them from pieces of up to 2^20 elements
  // (kInputPieceElements): the generator's two blocks of the disc's points (x, y, r2) in double, a
  // point for two elements, and its piece; or a --load file's piece as read and as converted (at
  // most 8 bytes an element each).
  const double pieceElements = std::min(double(kInputPieceElements), largestNumel);
  const double cutting = 2 * 3 * 8 * std::ceil(pieceElements / 2) + 16 * pieceElements;
  // A checkpoint's reads: while the pieces are cut, the chunks the last one overlapped; as the ranks
  // load, a chunk each; and what their loads leave resident: each reads its chunks into a host
  // buffer and a backend tensor beside its shard. The results the ranks keep mostly reuse those;
  // without them they stay (measured above the same run's peak on generated data, on columns of 32M
  // parameters at T = 1-8 on two threads: 0.05-0.56 of the parameters' bytes with the results kept,
  // the most where the peak comes as the ranks load, and 0.41-1.07 without, in a build whose one
  // process kept none either).
  const CheckpointBuffers& ckpt = scope.checkpoint;
  const double loads = ckpt.loaded ? (resultsKept ? 0.6 : 1.1) * fraction * activationBytes * held : 0;
  const double cache = ckpt.loaded ? ckpt.cacheBytes : 0, ranksReading = ckpt.loaded ? threads * ckpt.chunkBytes : 0;
  const double live =
      loads + (scope.whole ? inputs + stacked + std::max({run, shards + ranksReading, cache, gathered, reference})
               : scope.part
                   ? partInputs + inputShards +
                         std::max({run, shards + ranksReading, cutting + cache, partGathered, reference})
                   : inputShards + std::max({run, shards + ranksReading, cutting + cache}));
  return program + live + std::min(0.05 * live, 16.0 * (1 << 20));
}

std::optional<AvailableMemory> availableMemory() {
  std::optional<AvailableMemory> out;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    long long kb = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kb) == 1)
      out = AvailableMemory{kb * 1024, "MemAvailable in /proc/meminfo"};
  }
  // cgroup v2, then v1 (where "no limit" is a number near 2^63).
  for (auto [limitFile, usageFile] : {std::pair{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
                                      {"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                       "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const std::optional<double> limit = readNumber(limitFile);
    if (!limit || *limit >= 0x1p62) continue;
    const double left = *limit - readNumber(usageFile).value_or(0);
    if (!out || left < double(out->bytes))
      out = AvailableMemory{std::int64_t(std::max(left, 0.0)), std::string("the cgroup's ") + limitFile +
                                                                   " less its usage"};
    break;
  }
  return out;
}

std::string bytesText(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  char text[64];
  std::snprintf(text, sizeof text, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return text;
}

void checkMemory(const RunConfig& c, const ShapeMap& shapes, VerifyMode verify, std::optional<std::int64_t> maxMemory,
                 const std::string& loadDir, bool resultsRead, const CheckpointBuffers& checkpoint, bool part) {
  const int processes = jobProcesses(), local = jobLocalProcesses();
  const double first = estimateRunBytes(
      c, shapes, verify, {resultsRead, processes, processes == 1 || (resultsRead && !part), checkpoint, part, true});
  const double other = processes == 1 ? first
                                      : estimateRunBytes(c, shapes, verify,
                                                         {resultsRead, processes, false, checkpoint, part, false});
  // Every process checks the same figures: the largest process's, and the sum over this machine's,
  // process 0's counted wherever it runs.
  const double need = std::max(first, other), machine = first + (local - 1) * other;
  const std::optional<AvailableMemory> available = availableMemory();
  std::string limit;
  if (maxMemory && double(*maxMemory) < need) limit = "--max-memory " + bytesText(double(*maxMemory));
  else if (available && double(available->bytes) < machine)
    limit = "the " + bytesText(double(available->bytes)) + " available (" + available->source + ")";
  if (limit.empty()) return;
  const std::string peak = processes == 1 ? bytesText(need)
                           : detail::concat(bytesText(need), " for the largest process of ", processes, " (",
                                            bytesText(machine), " for the ", local, " on this machine)");
  std::string from = "--tp " + std::to_string(c.tp);
  if (c.gtpRemat > 1) from += " --gtp-remat " + std::to_string(c.gtpRemat);
  if (loadDir.empty()) {
    for (const auto& [flag, value] : shapeFlags(c)) from += " --" + flag + " " + std::to_string(value);
  } else {
    from += ", the shapes of the --load files";
  }
  const char* verifyName = verify == VerifyMode::kBound ? "bound" : verify == VerifyMode::kExact ? "exact" : "none";
  throw InvalidArgument(detail::concat(
      "tpsim run: expected a run that fits in memory, got an estimated peak of ", peak, " for --layer ",
      c.layer->name(), " ", from, " and --verify ", verifyName, ", more than ", limit,
      "; use smaller sizes or fewer ranks", verify == VerifyMode::kNone ? "" : ", or --verify none"));
}

}  // namespace tpsim::tools
