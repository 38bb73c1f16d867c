// Random worlds spread over the processes of an MPI job must compute, bit for bit, what the same
// worlds compute in one process (tests/mpi/mpi_test.sh, mode props, runs this in one process and
// under mpiexec -n P and compares the lines).
//
//   split_props SEED P CASES
//
// Draws CASES pairs of cases from SEED, every world's size a multiple of P:
//  - a layer case: any layer kind with any option (props/generators.h genRunConfig), GTP_remat in
//    about one case in three, run by tools::runSharded; process 0 prints a hash of every rank's
//    results and of the collectives each rank issued;
//  - a distributed-optimizer case: a drawn model's gradients on a (T, G, D) world, cut by
//    distOptFragments over each optimizer instance; every rank prints its fragments and the grad
//    norm and zero count over them (reduced over intraDistOpt) and over whole gradients.
// Each line names the seed, the case and its configuration, so a differing line is a failing case
// to replay: split_props SEED P CASES prints the same case first. Without a launcher P only
// selects the cases.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "backends/mpi/session.h"
#include "core/attributes.h"
#include "core/grad_stats.h"
#include "core/gtp.h"
#include "core/process_groups.h"
#include "props/generators.h"
#include "tools/lib/job.h"
#include "tools/lib/runner.h"

namespace {

using namespace tpsim;
using props::pick;

// FNV-1a, continued over `bytes`.
void hashInto(std::uint64_t& h, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
}
void hashInto(std::uint64_t& h, const std::string& s) { hashInto(h, s.data(), s.size() + 1); }

std::string hex(std::uint64_t h) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}
std::string hex(double x) {
  std::uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return hex(bits);
}

template <class T>
T draw(const rc::Gen<T>& gen, std::uint64_t seed, int size) {
  return gen(rc::Random(seed), size).value();
}

// Every rank's results, bit for bit, and every collective each rank issued.
std::string layerCase(std::uint64_t seed, int processes, int size) {
  std::vector<const tools::LayerKind*> kinds;
  for (const tools::LayerKind* k : tools::layerKinds()) kinds.push_back(k);
  tools::RunConfig c = draw(rc::gen::suchThat(props::genRunConfig(kinds, props::genTp(), props::GtpMode::kSometimes),
                                              [processes](const tools::RunConfig& rc) {
                                                return rc.tp * rc.gtpRemat % processes == 0;
                                              }),
                            seed, size);
  c.threads = 1;
  const tools::TensorMap inputs = props::realInputs(c);
  const tools::RunResult result =
      tools::runSharded(c, tools::storedOf(inputs), {}, nullptr, tools::KeptResults::kSharded);
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& [name, sharded] : result.sharded) {
    hashInto(h, name);
    for (const tools::StoredTensor& t : sharded.ranks) hashInto(h, t.bytes.data(), t.bytes.size());
  }
  for (const auto& events : result.trace)
    for (const TraceEvent& e : events) {
      hashInto(h, e.op + " " + e.group + " " + e.dtype);
      hashInto(h, &e.seq, sizeof e.seq);
      hashInto(h, &e.bytes, sizeof e.bytes);
    }
  std::ostringstream line;
  line << "layer: " << c.str();
  if (c.gtpRemat > 1) line << " [" << props::gtpSummary(c) << "]";
  line << " -> " << hex(h);
  return line.str();
}

// One parameter of a drawn model, as props/dist_opt_props.cc draws them.
struct ParamSpec {
  enum Kind { kWeight, kTpBias, kReplicated } kind = kWeight;
  std::int64_t rows = 1;
  std::vector<std::int64_t> trailing;
  int a = 16;
  bool inMainGrad = true;
};

Tensor tensorOf(Compute& compute, DType dtype, const std::vector<double>& values, const Shape& shape) {
  Tensor t = compute.empty(shape, dtype);
  std::vector<char> host(values.size() * dtypeSize(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) storeFromDouble(dtype, values[i], host.data() + i * dtypeSize(dtype));
  compute.upload(host.data(), t);
  return t;
}

// A distributed-optimizer case: the grid, the optimizer's instances, the model and its values.
struct DistOptCase {
  int T = 1, G = 1, D = 1, instances = 1, expertGtp = 1;
  DType dtype = DType::kFloat32;
  std::vector<ParamSpec> specs;
  std::uint64_t valueSeed = 0;
  int world() const { return T * G * D; }
  std::string str() const {
    std::ostringstream os;
    os << "distopt: T=" << T << " G=" << G << " D=" << D << " EG=" << expertGtp << " instances=" << instances << " "
       << dtypeName(dtype) << " params";
    for (const ParamSpec& s : specs) {
      const char* kinds[] = {"weight", "tp-bias", "replicated"};
      os << " " << kinds[s.kind] << "(" << s.rows;
      for (std::int64_t d : s.trailing) os << "x" << d;
      os << (s.kind == ParamSpec::kWeight ? " a=" + std::to_string(s.a) : "") << (s.inMainGrad ? "" : " grad") << ")";
    }
    return os.str();
  }
};

// As props/dist_opt_props.cc draws them, with world sizes of at most 16 that `processes` divides.
DistOptCase drawDistOpt(std::uint64_t seed, int processes) {
  std::mt19937_64 rng(seed);
  auto among = [&rng](std::vector<int> v) { return v[rng() % v.size()]; };
  DistOptCase c;
  do {
    c.T = among({1, 2, 3, 4});
    c.G = among({1, 2, 3, 4});
    c.D = among({1, 2, 3});
  } while (c.world() % processes != 0 || c.world() > 16);
  std::vector<int> instanceChoices = {1};
  if (c.G == 1)
    for (int i = 2; i <= c.D; ++i)
      if (c.D % i == 0) instanceChoices.push_back(i);
  c.instances = among(instanceChoices);
  c.expertGtp = c.G > 1 ? among({c.G, 1}) : 1;
  c.dtype = rng() % 2 ? DType::kBFloat16 : DType::kFloat32;
  c.specs.resize(1 + rng() % 5);
  for (ParamSpec& s : c.specs) {
    s.kind = ParamSpec::Kind(rng() % 3);
    s.rows = among({3, 1, 2, 5, 7, 16, 31});
    if (s.kind == ParamSpec::kWeight) {
      if (rng() % 2) s.rows *= c.G;
      const std::vector<std::vector<std::int64_t>> trailings = {{4}, {}, {1}, {3}, {2, 3}};
      s.trailing = trailings[rng() % trailings.size()];
      // a = 0 asserts that the rows divide by G (SPEC 4.2).
      s.a = s.rows % c.G == 0 ? among({16, 0, 1, 32}) : among({16, 1, 32});
    }
    s.inMainGrad = rng() % 2;
  }
  c.valueSeed = rng();
  return c;
}

// Each rank's fragments and the statistics over them, bit for bit, one line per rank.
std::vector<std::string> distOptLines(World& world, const DistOptCase& c, const std::string& prefix) {
  const std::vector<ParamSpec>& specs = c.specs;
  const DType dtype = c.dtype;
  const std::uint64_t valueSeed = c.valueSeed;
  const int instances = c.instances;
  std::vector<std::string> lines;
  ParallelSizes sizes;
  sizes.world = c.world();
  sizes.tp = c.T;
  sizes.gtpRemat = c.G;
  sizes.expertGtpRemat = c.expertGtp;
  sizes.distOptInstances = c.instances;
  const ParallelLayout layout(sizes);
  std::mutex mu;
  world.run([&](RankContext& ctx) {
    Compute& compute = ctx.compute;
    ProcessGroups pg(ctx.comm, layout);
    const int t = pg.tp().rank();
    std::vector<Parameter> storage(specs.size());
    std::vector<Parameter*> params;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const ParamSpec& s = specs[i];
      Parameter& p = storage[i];
      p.name = "p" + std::to_string(i);
      std::vector<std::int64_t> dims{s.rows};
      dims.insert(dims.end(), s.trailing.begin(), s.trailing.end());
      const Shape shape(dims.data(), int(dims.size()));
      // This rank's TP slice of the model's values (the same on every GTP_remat and DP peer); one
      // element in three is zero, so the count has zeros to find.
      const std::int64_t first = s.kind == ParamSpec::kReplicated ? 0 : t * shape.numel();
      std::vector<double> values(std::size_t(shape.numel()));
      for (std::int64_t j = 0; j < shape.numel(); ++j) {
        std::mt19937_64 element(valueSeed * 1000003u + i * 7919u + std::uint64_t(first + j));
        values[std::size_t(j)] = element() % 3 == 0 ? 0.0 : std::normal_distribution<double>(0, 1)(element);
      }
      p.data = tensorOf(compute, dtype, values, shape);
      if (s.kind != ParamSpec::kReplicated) setTensorModelParallelAttributes(p.attrs, true, 0, 1);
      if (s.kind == ParamSpec::kWeight) wrapGtp(compute, p, pg.gtpRemat(), s.a);
      Tensor grad = compute.empty(p.data.shape(), dtype);
      compute.copy(p.data, grad);
      (s.inMainGrad ? p.mainGrad : p.grad) = std::move(grad);
      params.push_back(&p);
    }
    const DuplicateFilter filter{&pg.tp(), nullptr, &pg.gtpRemat(), nullptr};
    const int perInstance = pg.dpCp().size() / instances;
    const std::vector<GradFragment> fragments = distOptFragments(params, pg.dpCp().rank() % perInstance, perInstance);
    const double fragmentNorm = gradNormL2(compute, fragments, filter, pg.intraDistOpt());
    const std::int64_t fragmentZeros = countZeros(compute, fragments, filter, pg.intraDistOpt());
    stampGtpPadZeros(params);
    const double wholeNorm = gradNormL2(compute, params, filter, pg.modelParallel());
    const std::int64_t wholeZeros = countZeros(compute, params, filter, pg.modelParallel());
    std::ostringstream line;
    line << prefix << c.str() << ": rank " << ctx.comm.rank() << " fragments";
    for (const GradFragment& f : fragments)
      line << " " << f.param->name << "[" << f.begin << "," << f.end << ") pad " << f.gtpPadZeros;
    line << "; norm " << hex(fragmentNorm) << " zeros " << fragmentZeros
         << "; whole norm " << hex(wholeNorm) << " zeros " << wholeZeros;
    std::lock_guard<std::mutex> lock(mu);
    lines.push_back(line.str());
  });
  return lines;
}

int runDriver(int argc, char** argv) {
  if (argc != 4) {
    std::fputs("usage: split_props SEED P CASES\n", stderr);
    return 2;
  }
  const std::uint64_t seed = std::stoull(argv[1]);
  const int processes = std::stoi(argv[2]), cases = std::stoi(argv[3]);
  tools::joinJob();
  TPSIM_CHECK(tools::jobProcesses() == 1 || tools::jobProcesses() == processes, "split_props: P = ", processes,
              ", but the job has ", tools::jobProcesses(), " processes");
  std::mt19937_64 seeds(seed);
  std::string out;  // this process's lines
  for (int k = 0; k < cases; ++k) {
    const std::uint64_t layerSeed = seeds(), distOptSeed = seeds();
    const std::string prefix = "seed " + std::to_string(seed) + " case " + std::to_string(k) + " ";
    // Only process 0 holds the gathered results.
    const std::string layer = layerCase(layerSeed, processes, k * 13 % 100);
    if (tools::jobProcess() == 0) out += prefix + layer + "\n";
    const DistOptCase distOpt = drawDistOpt(distOptSeed, processes);
    WorldOptions o;
    o.size = distOpt.world();
    o.threads = 1;
    std::unique_ptr<World> world = tools::makeJobWorld("sim", o);
    for (const std::string& line : distOptLines(*world, distOpt, prefix)) out += line + "\n";
  }
  // Process 0 prints every process's lines: the launcher may cut lines that processes write at once.
  if (mpi::Session* session = tools::jobSession()) {
    std::string all;
    for (const std::string& part : session->gather(out, std::chrono::minutes(1))) all += part;
    out = all;
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  return tools::leaveJob(0);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return runDriver(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "split_props: %s\n", e.what());
    return tpsim::tools::leaveJob(3);
  }
}
