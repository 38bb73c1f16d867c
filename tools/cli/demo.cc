// tpsim demo: the main job. An MLP block (ColumnParallelLinear fc1, exact GeLU, RowParallelLinear
// fc2, both with biases) at TP = 4 with sequence parallelism and GTP_remat = 2 on the simulator
// (8 ranks; --gtp-remat 1 turns GTP_remat off): the configuration,
// each rank's shards, the collectives each rank issued, and every output and gradient checked
// against the unsharded computation. Exit 0 only if all agree.
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <map>
#include <sstream>

#include "tools/lib/backend.h"
#include "tools/lib/input_file.h"
#include "tools/lib/job.h"
#include "tools/cli/cli.h"
#include "tools/lib/output_files.h"
#include "tools/lib/runner.h"

namespace po = boost::program_options;

namespace tpsim::tools {

DemoArgs parseDemoArgs(const std::vector<std::string>& args) {
  DemoArgs out;
  RunConfig& c = out.config;
  c.layer = layerKind("mlp");
  c.tp = 4;
  c.sequenceParallel = true;
  c.bias = true;
  c.inFeatures = 16;
  c.ffnHidden = 64;
  c.gtpRemat = 2;
  std::string dtype = "fp32", seed, timeout = "60";
  std::vector<std::string> injects;
  TraceOptions& trace = out.trace;
  bool noSequenceParallel = false;
  po::options_description opts("tpsim demo [options]");
  opts.add_options()
      ("help,h", "show this help")
      ("tp,p", po::value(&c.tp)->default_value(c.tp), "tensor-parallel size T")
      ("no-sequence-parallel", po::bool_switch(&noSequenceParallel), "all-reduce instead of sequence parallelism")
      ("gtp-remat,G", po::value(&c.gtpRemat)->default_value(c.gtpRemat),
       "GTP_remat size G: fc1 and fc2 weights sharded again over G peers (world T x G)")
      ("dtype,d", po::value(&dtype)->default_value(dtype), "fp32 | bf16 | fp16")
      ("seq,s", po::value(&c.seq)->default_value(c.seq), "sequence length s")
      ("batch,b", po::value(&c.batch)->default_value(c.batch), "micro-batch b")
      ("hidden,k", po::value(&c.inFeatures)->default_value(c.inFeatures), "hidden size h")
      ("ffn-hidden,f", po::value(&c.ffnHidden)->default_value(c.ffnHidden), "ffn hidden size F")
      ("seed", po::value(&seed)->default_value(std::to_string(c.seed)), "seed of the generated data")
      ("threads,t", po::value(&c.threads)->default_value(c.threads), "sim threads (0 = every core): min(threads, ranks) run ranks, the rest share large GEMMs")
      ("backend,B", po::value(&c.backend)->default_value(c.backend),
       "sim | gpu: the simulator, or CUDA devices (exit 2 with the reason where none is usable)")
      ("timeout", po::value(&timeout)->default_value(timeout)->value_name("SECONDS"), kTimeoutHelp)
      ("inject", po::value(&injects)->composing()->value_name("RANK:K:FAULT"), kInjectHelp)
      ("trace", po::value(&trace.file)->value_name("FILE.json"), kTraceHelp)
      ("clock", po::value(&trace.clock)->default_value(trace.clock), kClockHelp)
      ("device-model", po::value(&trace.device)->default_value(trace.device), kDeviceModelHelp);
  const po::variables_map vm = parseOptions(args, opts);
  if (vm.count("help")) {
    std::ostringstream help;
    help << opts << "\n" << kExitCodes;
    out.help = help.str();
    return out;
  }
  if (dtype != "fp32" && dtype != "bf16" && dtype != "fp16")
    throw UsageError{"--dtype: expected fp32, bf16 or fp16, got '" + dtype + "'"};
  c.dtype = parseDType(dtype);
  c.seed = parseSeed(seed);
  c.faults = parseInjections(injects);
  c.timeout = parseTimeout(timeout);
  c.sequenceParallel = !noSequenceParallel && c.tp > 1;
  c.validate();
  checkSizes(c, {SizeSources::Inputs::kFlags, ""});
  if (vm.count("trace") && trace.file.empty()) throw UsageError{"--trace: expected a file path, got an empty path"};
  checkTraceOptions(trace, !vm["clock"].defaulted(), !vm["device-model"].defaulted());
  c.record = !trace.file.empty();
  if (!isBackendName(c.backend)) throw UsageError{"--backend: expected sim or gpu, got '" + c.backend + "'"};
  if (const std::string whyNot = backendUnusableReason(c.backend); !whyNot.empty())
    throw UsageError{"--backend " + c.backend + ": cannot run here: " + whyNot};
  return out;
}

int demoMain(const std::vector<std::string>& args) {
  const DemoArgs parsed = parseDemoArgs(args);
  if (!parsed.help.empty()) {
    std::cout << parsed.help;
    return 0;
  }
  const RunConfig& c = parsed.config;
  const TraceOptions& trace = parsed.trace;
  FileUses uses;  // before the run: a trace that would replace its own device model is refused
  if (const std::string model = trace.modelFile(); !model.empty()) uses.read({"--device-model"}, model);
  if (!trace.file.empty()) uses.write({"--trace"}, trace.file);
  std::printf("# tpsim demo: MLP block y = GeLU(x·W1ᵀ + b1)·W2ᵀ + b2 on %d %s ranks\n", c.tp * c.gtpRemat,
              c.backend == "sim" ? "simulated" : "GPU");
  std::printf("# fc1 = ColumnParallelLinear(h=%lld -> F=%lld), fc2 = RowParallelLinear(F -> h, input_is_parallel)\n",
              (long long)c.inFeatures, (long long)c.ffnHidden);
  std::printf("# %s\n", c.str().c_str());
  std::printf("# x (s=%lld, b=%lld, h=%lld)%s%s\n\n", (long long)c.seq, (long long)c.batch, (long long)c.inFeatures,
              c.sequenceParallel ? ": each rank holds s/T rows of the sequence" : "",
              c.gtpRemat > 1 ? " and GTP_remat peer g the batch block g" : "");
  const InputMap inputs = generateInputs(c);
  const RunResult r = runSharded(c, inputs);
  if (jobProcess() != 0) return 0;  // process 0 reports (docs/distributed.md)
  const LayerGrid grid(c.tp, c.gtpRemat);

  // Each parameter's placement, then the blocks of it each rank holds (tpsim layout draws them).
  std::printf("# shards: each parameter's placement, then the global rows x columns each rank holds\n");
  std::vector<const TensorPlacement*> params;
  for (const TensorPlacement& p : r.placements)
    if (p.role == TensorRole::kParameter) params.push_back(&p);
  for (const TensorPlacement* p : params)
    std::printf("%s %s: %s\n", p->name.c_str(), shapeText(p->shape).c_str(), placementText(*p).c_str());
  for (int rank = 0; rank < grid.size(); ++rank) {
    const int t = grid.t(rank), g = grid.g(rank);
    std::printf("rank %d (t=%d, g=%d):", rank, t, g);
    for (const TensorPlacement* p : params)
      std::printf("\n  %s %s: %s", p->name.c_str(), shapeText(localShape(*p, t, g)).c_str(), holdsText(*p, t, g).c_str());
    std::printf("\n");
  }
  std::printf("\n# collectives each rank issued, in order (op group bytes-sent; the splits that build the groups"
              " are left out)\n");
  for (int rank = 0; rank < grid.size(); ++rank) {
    std::printf("rank %d:", rank);
    for (const auto& e : r.trace[rank])
      if (e.op != "split") std::printf("  %s %s %lldB", e.op.c_str(), e.group.c_str(), (long long)e.bytes);
    std::printf("\n");
  }

  std::printf("\n# verification against the unsharded computation in double precision\n");
  std::printf("# bound: ((reduction length + 2) · 2^-24 + roundings · u(dtype)) · (the same math on |values|)\n");
  std::printf("# slack: the least bound / |err| of an element (docs/bounds.md)\n");
  std::printf("%-18s %-14s %12s %12s %9s %9s  %s\n", "tensor", "shape", "max|err|", "bound", "slack", "#outside",
              "result");
  bool ok = true;
  std::string notes;
  for (const Verdict& v : verify(c, inputs, r)) {
    ok = ok && v.outside == 0;
    std::printf("%-18s %-14s %12.3e %12.3e %9s %9lld  %s\n", v.name.c_str(), v.shape.c_str(), v.maxError, v.maxBound,
                slackText(v).c_str(), (long long)v.outside, verdictResult(v).c_str());
    notes += outsideNote(v) + nonFiniteNote(v);
  }
  if (!notes.empty()) std::printf("\n%s", notes.c_str());
  if (c.record) {
    const std::vector<RankSummary> summary = writeTrace(trace, r.records, grid);
    std::printf("\n# timeline, clock %s, written to %s; per rank in µs: compute ops, collectives from issue to "
                "completion,\n# exposed = waiting for one, overlap = collectives under compute, other = the rest "
                "(host work outside ops)\n%s",
                terminalText(trace.clockText()).c_str(), terminalText(trace.file).c_str(), summaryTable(summary).c_str());
  }
  std::printf("\n%s\n", ok ? "every output and gradient agrees with the unsharded MLP" : "MISMATCH");
  return ok ? 0 : 1;
}

}  // namespace tpsim::tools
