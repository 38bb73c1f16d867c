// tpsim run: one layer (column, row, embedding or the MLP block) sharded over a simulated TP
// group, on generated data or on your own NumPy files, checked against the unsharded computation.
// The command line is a contract for outside harnesses; see README.md ("tpsim run").
#include <boost/program_options.hpp>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <exception>
#include <optional>
#include <sstream>

#include "backends/errors.h"
#include "tools/lib/backend.h"
#include "tools/cli/cli.h"
#include "tools/lib/input_file.h"
#include "tools/lib/job.h"
#include "tools/lib/memory.h"
#include "tools/lib/npy.h"
#include "tools/lib/output_files.h"
#include "tools/lib/runner.h"

namespace po = boost::program_options;

namespace tpsim::tools {
namespace {

// The tensors of c's layer that --load reads (withParams false: not the parameters, which come
// from --load-checkpoint).
std::vector<TensorSpec> loadedTensors(const RunConfig& c, bool withParams) {
  std::vector<TensorSpec> out;
  for (const TensorSpec& t : c.layer->tensors(c))
    if (withParams || t.role != TensorRole::kParameter) out.push_back(t);
  return out;
}

// The parameters: what a checkpoint holds, under the same names.
std::vector<TensorSpec> parameters(const RunConfig& c) {
  std::vector<TensorSpec> out;
  for (const TensorSpec& t : c.layer->tensors(c))
    if (t.role == TensorRole::kParameter) out.push_back(t);
  return out;
}

std::string joinNames(const std::vector<TensorSpec>& tensors, const std::string& suffix = "") {
  std::string all;
  for (const TensorSpec& t : tensors) all += (all.empty() ? "" : ", ") + t.name + suffix;
  return all;
}

// DIR/NAME.npy for each tensor --load reads, checked to exist, with whether it holds token ids.
struct InputFile {
  std::string name, path;
  bool ids = false;
};
std::vector<InputFile> inputFiles(const RunConfig& c, const std::string& dir, bool withParams) {
  TPSIM_CHECK(std::filesystem::is_directory(dir), "--load: ", dir, " is not a directory");
  const std::vector<TensorSpec> tensors = loadedTensors(c, withParams);
  std::vector<InputFile> files;
  for (const TensorSpec& t : tensors) {
    const std::string file = (std::filesystem::path(dir) / (t.name + ".npy")).string();
    TPSIM_CHECK(std::filesystem::exists(file), "--load: ", file, " is missing; --layer ", c.layer->name(), " reads ",
                joinNames(tensors, ".npy"));
    files.push_back({t.name, file, !t.idRange.empty()});
  }
  return files;
}

// The inputs' shapes from the headers alone, to size the run before reading the data.
ShapeMap loadShapes(const RunConfig& c, const std::string& dir, bool withParams) {
  ShapeMap m;
  for (const InputFile& f : inputFiles(c, dir, withParams)) m[f.name] = readNpyHeader(f.path).shape;
  return m;
}

// Each file in turn, handed to `sink` a piece at a time as it is read, converted to the run's dtype.
void load(const RunConfig& c, const std::string& dir, bool withParams, InputSink& sink) {
  for (const InputFile& f : inputFiles(c, dir, withParams)) {
    NpyReader reader(f.path);
    const DType want = f.ids ? DType::kInt64 : c.dtype;
    checkIdsOrValues(reader.dtype(), want, f.path);
    const std::int64_t n = reader.numel();
    std::vector<char> raw(std::size_t(std::min(n, kInputPieceElements)) * dtypeSize(reader.dtype()));
    std::vector<char> converted(std::size_t(std::min(n, kInputPieceElements)) * dtypeSize(want));
    sink.begin(f.name, {reader.shape(), want});
    for (std::int64_t first = 0; first < n; first += kInputPieceElements) {
      const std::int64_t count = std::min(kInputPieceElements, n - first);
      if (!sink.wants(first, count)) {
        reader.skip(count);
        continue;
      }
      reader.read(count, raw.data());
      convertElements(reader.dtype(), raw.data(), count, want, converted.data());
      sink.piece(first, count, converted.data());
    }
    sink.end();
  }
}

// --save DIR or --save-checkpoint DIR, before the inputs are read: an existing directory, or a path
// below the nearest one that exists, where it can be created.
void checkSaveDir(const std::string& flag, const std::string& dir) {
  std::error_code ec;
  std::filesystem::path existing = std::filesystem::absolute(dir, ec);
  while (!ec && !std::filesystem::exists(existing, ec) && existing.has_relative_path())
    existing = existing.parent_path();
  TPSIM_CHECK(!ec && std::filesystem::is_directory(existing, ec), "--", flag, ": expected a directory or a path where "
              "one can be created, got '", dir, "' (",
              ec ? ec.message() : existing.string() + " is not a directory", ")");
}
// The same, created once the run's inputs are read and checked: a refused run leaves nothing behind.
void makeSaveDir(const std::string& flag, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TPSIM_CHECK(!ec && std::filesystem::is_directory(dir), "--", flag, ": expected a directory or a path where one can "
              "be created, got '", dir, "' (", ec ? ec.message() : "not a directory", ")");
}

// The parameters' shapes as the index of the checkpoint in `dir` gives them, before any of its
// files is read; the shape flags follow them, so that generated input and grad_output fit and the
// memory check sizes the run. A checkpoint of another kind of layer, or whose keys do not fit one
// layer of c's kind, is refused here, before the world starts.
ShapeMap checkpointShapes(RunConfig& c, const CheckpointIndex& index, const std::string& dir) {
  std::string held;
  for (const auto& [key, k] : index.keys()) held += (held.empty() ? "" : ", ") + key;
  for (const TensorSpec& t : parameters(c)) {
    const std::string key = c.layer->checkpointSlot(t.name).key;
    TPSIM_CHECK(index.keys().count(key), "--load-checkpoint: expected key '", key, "' in ", dir, " (--layer ",
                c.layer->name(), c.bias ? " --bias" : "", " reads ", joinNames(parameters(c)), "), got only ",
                held.empty() ? "no keys" : printable(held, 400));
  }
  // The keys are there; they must also mean what c's kind means by them.
  const LayerKind* saved = findLayerKind(index.layer());
  std::string loads;  // the kinds whose checkpoints c's kind loads
  for (const LayerKind* k : layerKinds())
    if (k->checkpointKind() == c.layer->checkpointKind()) loads += (loads.empty() ? "" : " or ") + std::string(k->name());
  TPSIM_CHECK(saved && saved->checkpointKind() == c.layer->checkpointKind(), "--load-checkpoint: expected a checkpoint "
              "saved by --layer ", loads, ", got one saved by ",
              index.layer().empty() ? std::string("no layer kind (its index names none)")
                                    : "--layer " + printable(index.layer(), 80),
              " in ", dir, "; another kind's parameters mean something else, even where the shapes agree");
  ShapeMap shapes;
  std::map<std::string, std::int64_t> entries;  // parameters kept along a key's leading axis
  for (const TensorSpec& t : parameters(c))
    if (const LayerKind::CheckpointSlot slot = c.layer->checkpointSlot(t.name); slot.index >= 0) ++entries[slot.key];
  for (const TensorSpec& t : parameters(c)) {
    const LayerKind::CheckpointSlot slot = c.layer->checkpointSlot(t.name);
    const CheckpointKey& k = index.key(slot.key);
    const std::size_t rank = t.dims.size() + (slot.index >= 0 ? 1 : 0);
    TPSIM_CHECK(k.globalShape.size() == rank && isFloating(k.dtype), "--load-checkpoint: key '", slot.key, "' in ",
                dir, ": expected a floating tensor of rank ", rank, ", got ", dtypeName(k.dtype), " of shape ",
                shapeText(k.globalShape));
    std::vector<std::int64_t> shape = k.globalShape;
    if (slot.index >= 0) {
      TPSIM_CHECK(shape[0] == entries.at(slot.key), "--load-checkpoint: key '", slot.key, "' in ", dir, ": expected ",
                  entries.at(slot.key), " entries along its leading axis (one per parameter of --layer ",
                  c.layer->name(), " kept there), got ", shape[0]);
      shape.erase(shape.begin());
    }
    shapes[t.name] = shape;
  }
  c = withSizesOf(c, shapes);
  // Each size comes from one key; every other key must agree with it.
  const ShapeMap want = tensorShapes(c);
  std::string sizes;
  for (const SizeSpec& s : c.layer->sizes())
    if (shapes.count(s.tensor)) sizes += (sizes.empty() ? "" : ", ") + s.symbol + " = " + std::to_string(c.*s.field);
  for (const TensorSpec& t : parameters(c)) {
    const LayerKind::CheckpointSlot slot = c.layer->checkpointSlot(t.name);
    TPSIM_CHECK(shapes.at(t.name) == want.at(t.name), "--load-checkpoint: key '", slot.key, "'",
                slot.index >= 0 ? detail::concat(" entry ", slot.index) : "", " in ", dir, ": expected shape ",
                shapeText(want.at(t.name)), " (--layer ", c.layer->name(), " ", t.name, " with ", sizes,
                ", as the checkpoint's keys give them), got ", shapeText(shapes.at(t.name)));
  }
  return shapes;
}

// The parameters of --load-checkpoint, of the `shapes` checkpointShapes gave, unsharded (pad rows
// dropped) and converted to --dtype, handed to `sink` a piece at a time as `load` hands the files:
// the dense reference's copy, or this process's ranks' shards (the ranks read their own chunks).
// The cache holds the chunks the last piece overlapped, at most one key's, until all are sent.
void sendCheckpointParams(const RunConfig& c, const CheckpointReader& reader, const ShapeMap& shapes, InputSink& sink) {
  CheckpointReader::ChunkCache cache;
  for (const TensorSpec& t : parameters(c)) {
    const LayerKind::CheckpointSlot slot = c.layer->checkpointSlot(t.name);
    const CheckpointKey& k = reader.key(slot.key);
    const std::vector<std::int64_t>& shape = shapes.at(t.name);
    std::int64_t rowElements = 1;  // of the parameter's first axis
    for (std::size_t i = 1; i < shape.size(); ++i) rowElements *= shape[i];
    const std::int64_t pieceRows =
        std::max<std::int64_t>(1, kInputPieceElements / std::max<std::int64_t>(rowElements, 1));
    const std::int64_t most = std::min(shape[0], pieceRows) * rowElements;
    std::vector<char> raw(std::size_t(most) * dtypeSize(k.dtype)), converted(std::size_t(most) * dtypeSize(c.dtype));
    // Its box in the key's tensor: the experts' parameters share a key, one index of its first axis each.
    std::vector<std::int64_t> begin(k.globalShape.size(), 0), box = shape;
    if (slot.index >= 0) {
      begin[0] = slot.index;
      box.insert(box.begin(), 1);
    }
    const std::size_t rowAxis = slot.index >= 0 ? 1 : 0;
    sink.begin(t.name, {shape, c.dtype});
    for (std::int64_t row = 0; row < shape[0]; row += pieceRows) {
      begin[rowAxis] = row;
      box[rowAxis] = std::min(pieceRows, shape[0] - row);
      const std::int64_t count = box[rowAxis] * rowElements;
      if (!sink.wants(row * rowElements, count)) continue;
      reader.readBox(slot.key, begin, box, raw.data(), &cache);
      convertElements(k.dtype, raw.data(), count, c.dtype, converted.data());
      sink.piece(row * rowElements, count, converted.data());
    }
    sink.end();
  }
}

// The .npy file of each tensor --save writes into DIR.
std::string savePath(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / (name + ".npy")).string();
}

// All the outputs or none, as unsharded .npy files in DIR (tools/lib/output_files.h): the results,
// each put together from the ranks' tensors only while its file is written, and `inputs`.
void save(const std::string& dir, const RunResult& result, const InputMap& inputs) {
  OutputFiles output("--save");
  std::map<std::string, std::function<HostTensor()>> tensors;
  for (const auto& [name, sharded] : result.sharded) tensors[name] = [&sharded = sharded] { return assembled(sharded); };
  for (const auto& [name, t] : inputs) tensors[name] = [&t = t] { return hostOf(t); };
  for (const auto& [name, make] : tensors) {
    const std::string path = savePath(dir, name);
    const HostTensor tensor = make();
    output.write(path, [&](std::FILE* f) {
      const std::string where = "--save: " + path;
      if (tensor.dtype == DType::kInt64) {
        const std::vector<std::int64_t> v(tensor.values.begin(), tensor.values.end());
        writeNpy(f, where, DType::kInt64, tensor.shape, v.data());
      } else {
        const std::vector<float> v(tensor.values.begin(), tensor.values.end());
        writeNpy(f, where, DType::kFloat32, tensor.shape, v.data());
      }
    });
  }
  output.commit();
}

// Every file the run reads and writes, registered before it writes any (FileUses): an output that
// would replace an input or another output is refused here, before the run.
void checkFileUses(const RunConfig& c, const RunArgs& a, const CheckpointIndex* checkpoint) {
  const auto name = [](const std::string& path) { return std::filesystem::path(path).filename().string(); };
  FileUses uses;
  if (!a.loadDir.empty())
    for (const InputFile& f : inputFiles(c, a.loadDir, !checkpoint)) uses.read({"--load", name(f.path)}, f.path);
  if (checkpoint)
    for (const std::string& path : checkpoint->paths()) uses.read({"--load-checkpoint", name(path)}, path);
  if (const std::string model = a.trace.modelFile(); !model.empty()) uses.read({"--device-model"}, model);
  if (!a.saveDir.empty()) uses.outputDirectory({"--save", "directory"}, a.saveDir);
  if (!a.saveCheckpoint.empty()) uses.outputDirectory({"--save-checkpoint", "directory"}, a.saveCheckpoint);
  if (!a.saveDir.empty()) {
    std::vector<std::string> saved = resultNames(c);
    if (a.loadDir.empty())
      for (const TensorSpec& t : c.layer->tensors(c)) saved.push_back(t.name);
    for (const std::string& tensor : saved) {
      const std::string path = savePath(a.saveDir, tensor);
      uses.write({"--save", name(path)}, path);
    }
  }
  if (!a.saveCheckpoint.empty())
    for (const std::string& path : checkpointOutputs(a.saveCheckpoint, c.tp * c.gtpRemat))
      uses.write({"--save-checkpoint", name(path)}, path);
  if (!a.trace.file.empty()) uses.write({"--trace"}, a.trace.file);
}

VerifyMode parseVerify(const std::string& s) {
  if (s == "bound") return VerifyMode::kBound;
  if (s == "exact") return VerifyMode::kExact;
  if (s == "none") return VerifyMode::kNone;
  throw UsageError{"--verify: expected bound, exact or none, got '" + s + "'"};
}

DType parseFloatDtype(const std::string& flag, const std::string& s) {
  if (s == "fp32" || s == "bf16" || s == "fp16") return parseDType(s);
  throw UsageError{"--" + flag + ": expected fp32, bf16 or fp16, got '" + s + "'"};
}

}  // namespace

RunArgs parseRunArgs(const std::vector<std::string>& args) {
  RunArgs out;
  RunConfig& c = out.config;
  std::string& loadDir = out.loadDir;
  std::string& saveDir = out.saveDir;
  std::string layer, dtype = "fp32", outputDtype, mainGradDtype = "fp32", maxMemory,
      gtpReduce = "mean", weightFormat = "native", verification = "bound", seed, timeout = "60";
  std::vector<std::string> injects;
  TraceOptions& trace = out.trace;
  po::options_description par("Parallelism");
  addParallelismOptions(par, c, layer);
  par.add_options()
      ("gtp-reduce", po::value(&gtpReduce)->default_value(gtpReduce), "GTP_remat wgrad reduction: mean | sum")
      ("fp32-accum-reduce-scatter", po::bool_switch(&c.fp32AccumReduceScatter),
       "GTP_remat: all-to-all + fp32 sum instead of the reduce-scatter (bypassed at G <= 2)");
  po::options_description lay("Layer options (Megatron's constructor arguments)");
  addLayerOptions(lay, c);
  lay.add_options()
      ("dtype,d", po::value(&dtype)->default_value(dtype), "fp32 | bf16 | fp16: params and activations")
      ("output-dtype", po::value(&outputDtype), "column: output dtype when it differs from --dtype")
      ("grad-accumulation-fusion", po::bool_switch(&c.gradAccumulationFusion), "add wgrads into main_grad")
      ("main-grad-dtype", po::value(&mainGradDtype)->default_value(mainGradDtype), "fp32 | bf16")
      ("weight-format", po::value(&weightFormat)->default_value(weightFormat),
       "column/row/mlp: native | mxfp8 (E4M3 weights, one E8M0 scale per 32; GTP_remat needs "
       "--pad-for-alignment 32)");
  po::options_description size("Problem size (generated data; the sizes --load's files or --load-checkpoint's keys "
                                "hold are theirs, and a flag given for one must agree)");
  addSizeOptions(size, c);
  po::options_description run("Run");
  run.add_options()
      ("backend,B", po::value(&c.backend)->default_value(c.backend),
       "sim | gpu: the simulator, or CUDA devices (exit 2 with the reason where none is usable)")
      ("seed", po::value(&seed)->default_value(std::to_string(c.seed)), "seed of the generated data")
      ("threads,t", po::value(&c.threads)->default_value(c.threads), "sim threads (0 = every core): min(threads, ranks) run ranks, the rest share large GEMMs")
      ("load", po::value(&loadDir), "read the unsharded tensors from DIR/*.npy")
      ("save", po::value(&saveDir), "write the unsharded results (and generated inputs) to DIR/*.npy")
      ("verify", po::value(&verification)->default_value(verification),
       "bound: each result within its data-derived bound of the unsharded computation in fp64 | exact: "
       "each element equal to that result rounded to the result's dtype (max|err| = 0; holds where every "
       "step is exact, e.g. small-integer data without GeLU) | none: skip the reference (exit 0)")
      ("max-memory", po::value(&maxMemory),
       "refuse (exit 2) a run whose estimated peak memory exceeds SIZE (bytes, or 512M, 8G); without it, "
       "or with more, the limit is the memory available")
      ("load-checkpoint", po::value(&out.loadCheckpoint),
       "read the parameters from the checkpoint in DIR, saved at any --tp, --gtp-remat, --pad-for-alignment or "
       "--dtype (input and grad_output still from --load or generated)")
      ("save-checkpoint", po::value(&out.saveCheckpoint),
       "write the parameters (as loaded or generated: run takes no step) as a sharded checkpoint to DIR")
      ("timeout", po::value(&timeout)->default_value(timeout)->value_name("SECONDS"), kTimeoutHelp)
      ("quiet,q", po::bool_switch(&out.quiet),
       "no progress line on stderr (shown only where stderr is a terminal, once a run has lasted "
       "TPSIM_PROGRESS_AFTER_MS, default 2000)");
  po::options_description faults("Faults (what a broken rank looks like to its peers)");
  faults.add_options()("inject", po::value(&injects)->composing()->value_name("RANK:K:FAULT"), kInjectHelp);
  po::options_description timeline("Timeline");
  timeline.add_options()
      ("trace", po::value(&trace.file)->value_name("FILE.json"), kTraceHelp)
      ("clock", po::value(&trace.clock)->default_value(trace.clock), kClockHelp)
      ("device-model", po::value(&trace.device)->default_value(trace.device), kDeviceModelHelp);
  po::options_description all("tpsim run --layer KIND [options]");
  all.add(par).add(lay).add(size).add(run).add(faults).add(timeline);
  const po::variables_map vm = parseOptions(args, all);
  if (vm.count("help")) {
    std::ostringstream help;
    help << all << "\n" << kExitCodes;
    out.help = help.str();
    return out;
  }
  if (layer.empty()) throw UsageError{"--layer is required: " + layerKindNames()};
  c.seed = parseSeed(seed);
  c.faults = parseInjections(injects);
  c.timeout = parseTimeout(timeout);
  // An empty path would silently mean "no --load" or "no --save".
  for (const char* flag : {"load", "save", "load-checkpoint", "save-checkpoint"})
    if (vm.count(flag) && vm[flag].as<std::string>().empty())
      throw UsageError{std::string("--") + flag + ": expected a directory, got an empty path"};
  c.layer = parseLayer(layer);
  out.sizeFlags = givenSizeFlags(size, vm, c);
  c.dtype = parseFloatDtype("dtype", dtype);
  if (!outputDtype.empty()) c.outputDtype = parseFloatDtype("output-dtype", outputDtype);
  if (mainGradDtype != "fp32" && mainGradDtype != "bf16")
    throw UsageError{"--main-grad-dtype: expected fp32 or bf16, got '" + mainGradDtype + "'"};
  c.mainGradDtype = parseDType(mainGradDtype);
  if (gtpReduce != "mean" && gtpReduce != "sum")
    throw UsageError{"--gtp-reduce: expected mean or sum, got '" + gtpReduce + "'"};
  c.gtpReduceMean = gtpReduce == "mean";
  if (weightFormat != "native" && weightFormat != "mxfp8")
    throw UsageError{"--weight-format: expected native or mxfp8, got '" + weightFormat + "'"};
  c.weightFormat = parseWeightFormat(weightFormat);
  out.verify = parseVerify(verification);
  if (vm.count("max-memory")) {
    out.maxMemory = parseSize("max-memory", maxMemory);
    if (*out.maxMemory < 1)
      throw UsageError{"--max-memory: expected a positive size like 512M or 8G, got '" + maxMemory + "'"};
  }
  if (!isBackendName(c.backend)) throw UsageError{"--backend: expected sim or gpu, got '" + c.backend + "'"};
  applyLayerConventions(c);
  c.validate();
  // A world the job cannot hold is refused in every process, before what this machine lacks.
  checkJobPlacement(c.backend, c.tp * c.gtpRemat);
  if (const std::string whyNot = backendUnusableReason(c.backend); !whyNot.empty())
    throw UsageError{"--backend " + c.backend + ": cannot run here: " + whyNot};
  if (vm.count("trace") && trace.file.empty()) throw UsageError{"--trace: expected a file path, got an empty path"};
  checkTraceOptions(trace, !vm["clock"].defaulted(), !vm["device-model"].defaulted());
  c.record = !trace.file.empty();
  if (!out.loadCheckpoint.empty() || !out.saveCheckpoint.empty()) checkCheckpointable(c);
  out.progressAfter = progressDelay();
  return out;
}

namespace {

// Takes every tensor into `shards`, and those named in `whole` whole as well, into `kept`: what a
// process of a spread world whose reference splits keeps of the inputs (PartInputs).
class ShardsAndWhole final : public InputSink {
 public:
  ShardsAndWhole(InputSink& shards, std::vector<std::string> whole, InputMap& kept)
      : shards_(shards), whole_(std::move(whole)), wholeInputs_([&kept](const std::string& name, StoredTensor t) {
          kept[name] = std::move(t);
        }) {}
  void begin(const std::string& name, const TensorHeader& header) override {
    shards_.begin(name, header);
    keeping_ = std::count(whole_.begin(), whole_.end(), name) != 0;
    if (keeping_) wholeInputs_.begin(name, header);
  }
  bool wants(std::int64_t offset, std::int64_t count) const override {
    return keeping_ || shards_.wants(offset, count);
  }
  void piece(std::int64_t offset, std::int64_t count, const char* bytes) override {
    shards_.piece(offset, count, bytes);
    if (keeping_) wholeInputs_.piece(offset, count, bytes);
  }
  void end() override {
    shards_.end();
    if (keeping_) wholeInputs_.end();
  }

 private:
  InputSink& shards_;
  const std::vector<std::string> whole_;
  WholeInputs wholeInputs_;
  bool keeping_ = false;
};

// A run whose flags, sizes, memory and inputs are checked, before its world starts.
struct PreparedRun {
  RunConfig config;
  HeaderMap headers;
  std::optional<CheckpointReader> reader;
  bool resultsRead = false;  // verified or saved
  // Whether this process holds the inputs whole (one process; process 0 of several when it verifies
  // or saves), or only its ranks' shards.
  bool whole = true;
  // Spread over processes whose reference splits (LayerKind::partResults): every process verifies
  // its part, from its part of the inputs, and keeps its part's results (docs/distributed.md).
  bool part = false;
  InputMap inputs;
  InputShards shards;
  PartInputs partInputs;
};

void prepareRun(const RunArgs& parsed, Progress& progress, PreparedRun& out) {
  RunConfig& c = out.config;
  c = parsed.config;
  const std::string &loadDir = parsed.loadDir, &saveDir = parsed.saveDir;
  const std::string &loadCheckpoint = parsed.loadCheckpoint, &saveCheckpoint = parsed.saveCheckpoint;
  const VerifyMode verifyMode = parsed.verify;
  // The checkpoint's index fixes the parameters' shapes and the shape flags before the memory check
  // reads them; its files are read once the run is known to fit, as --load's are.
  std::optional<CheckpointIndex> index;
  ShapeMap paramShapes;
  if (!loadCheckpoint.empty()) {
    progress.phase("load checkpoint");
    index.emplace(loadCheckpoint);
    paramShapes = checkpointShapes(c, *index, loadCheckpoint);
  }
  // Each size is named by where it comes from: a flag, a --load file or the checkpoint.
  const SizeSources sources{loadDir.empty() ? SizeSources::Inputs::kFlags : SizeSources::Inputs::kFiles,
                            loadCheckpoint};
  if (loadDir.empty()) checkSizes(c, sources);  // the files' sizes are believed once checkInputs has read them
  ShapeMap shapes = loadDir.empty() ? tensorShapes(c) : loadShapes(c, loadDir, !index);
  for (const auto& [name, shape] : paramShapes) shapes[name] = shape;
  HeaderMap& headers = out.headers;
  for (const TensorSpec& t : c.layer->tensors(c))
    headers[t.name] = {shapes.at(t.name), t.idRange.empty() ? c.dtype : DType::kInt64};
  const RunConfig sized = checkInputHeaders(c, headers, sources);
  checkGivenSizes(parsed.config, parsed.sizeFlags, sized, sources);
  // Before anything else is allocated: a run that cannot fit is refused, not killed by the kernel.
  // Spread over processes, only process 0 verifies and saves: a process that does neither holds no
  // whole input, only its ranks' shards, cut from one tensor at a time; and when process 0 does
  // neither, no rank keeps its results (docs/distributed.md, "Memory").
  out.resultsRead = verifyMode != VerifyMode::kNone || !saveDir.empty();
  out.part = jobProcesses() > 1 && verifyMode != VerifyMode::kNone && saveDir.empty() &&
             !c.layer->partResults(sized).empty();
  const CheckpointBuffers buffers =
      index ? CheckpointBuffers{true, double(index->chunkCacheBytes(kInputPieceElements)),
                                double(index->largestChunkBytes())}
            : CheckpointBuffers{};
  checkMemory(c, shapes, verifyMode, parsed.maxMemory, loadDir, out.resultsRead, buffers, out.part);
  checkFileUses(c, parsed, index ? &*index : nullptr);
  std::optional<CheckpointReader>& reader = out.reader;
  if (index) reader.emplace(std::move(*index));

  if (!saveDir.empty()) checkSaveDir("save", saveDir);
  if (!saveCheckpoint.empty()) checkSaveDir("save-checkpoint", saveCheckpoint);
  progress.above([&] { std::printf("# tpsim run: %s\n", c.str().c_str()); });
  progress.phase(loadDir.empty() ? "generate" : "load");
  out.whole = jobProcesses() == 1 || (jobProcess() == 0 && out.resultsRead && !out.part);
  InputMap& inputs = out.inputs;
  WholeInputs wholeInputs([&inputs](const std::string& name, StoredTensor t) { inputs[name] = std::move(t); });
  const std::vector<TensorPlacement> placements = out.whole ? std::vector<TensorPlacement>{} : placementsOf(sized);
  ShardedInputs shardedInputs(sized, placements);
  InputMap partWhole;
  ShardsAndWhole shardsAndWhole(
      shardedInputs, out.part ? partWholeInputs(sized, placements) : std::vector<std::string>{}, partWhole);
  CheckedInputs checked(sized, sources,
                        out.whole  ? static_cast<InputSink&>(wholeInputs)
                        : out.part ? static_cast<InputSink&>(shardsAndWhole)
                                   : shardedInputs);
  if (loadDir.empty()) generateInputs(c, checked);
  else load(c, loadDir, !reader, checked);
  if (reader) sendCheckpointParams(c, *reader, paramShapes, checked);
  out.shards = shardedInputs.release();
  if (out.part) out.partInputs = partInputs(sized, placements, out.shards, std::move(partWhole));
#if defined(__GLIBC__)
  // The pieces' and the generator's buffers, free now below the shards, go back to the system
  // (keepFreedMemory would keep them resident beside the run's).
  if (!out.whole) malloc_trim(0);
#endif
  // Once the sizes are checked, the layer's `_extra_state` entries, before the world runs: a
  // checkpoint without them is bad input, not a rank's failure.
  if (reader)
    for (const ShardedObject& o : checkpointObjectsOf(c)) reader->checkObject(o);
  if (jobProcess() == 0) {  // which writes them (docs/distributed.md)
    if (!saveDir.empty()) makeSaveDir("save", saveDir);
    if (!saveCheckpoint.empty()) makeSaveDir("save-checkpoint", saveCheckpoint);
  }
}

}  // namespace

int runMain(const std::vector<std::string>& args) {
  const RunArgs parsed = parseRunArgs(args);
  if (!parsed.help.empty()) {
    std::cout << parsed.help;
    return 0;
  }
  Progress progress("tpsim run", progressWanted(parsed.quiet), parsed.progressAfter);
  PreparedRun prepared;
  std::exception_ptr refusal;
  try {
    prepareRun(parsed, progress, prepared);
  } catch (...) {
    refusal = std::current_exception();
  }
  // Agreed among the job's processes: each fails with the first one's failure, its first line.
  const CommandFailure failure = refusal ? failureOf("run", refusal) : CommandFailure{};
  const std::string prefix = "tpsim run: ", line = failure.text.substr(0, failure.text.find('\n'));
  agreeToRun(refusal, failure.code, line.compare(0, prefix.size(), prefix) == 0 ? line.substr(prefix.size()) : line,
             parsed.config.timeout);
  const RunConfig& c = prepared.config;
  const std::string &loadDir = parsed.loadDir, &saveDir = parsed.saveDir;
  const std::string &loadCheckpoint = parsed.loadCheckpoint, &saveCheckpoint = parsed.saveCheckpoint;
  const VerifyMode verifyMode = parsed.verify;
  const TraceOptions& trace = parsed.trace;
  const HeaderMap& headers = prepared.headers;
  const InputMap& inputs = prepared.inputs;
  std::optional<CheckpointReader>& reader = prepared.reader;
  const bool resultsRead = prepared.resultsRead;
  progress.above([&] {
    std::printf("# inputs (%s%s%s):", loadDir.empty() ? "generated" : terminalText(loadDir).c_str(),
                reader ? "; parameters from checkpoint " : "", reader ? terminalText(loadCheckpoint).c_str() : "");
    for (const auto& [name, header] : headers) std::printf(" %s %s", name.c_str(), shapeText(header.shape).c_str());
    std::printf("\n");
  });
  CheckpointWriter writer(c.layer->name());
  const CheckpointHooks hooks{reader ? &*reader : nullptr, saveCheckpoint.empty() ? nullptr : &writer};
  // One process keeps them all the same: its estimate's terms were measured with them kept.
  const KeptResults kept = prepared.part                           ? KeptResults::kPart
                           : resultsRead || jobProcesses() == 1 ? KeptResults::kSharded
                                                                 : KeptResults::kNone;
  const RunResult result = prepared.whole ? runSharded(c, inputs, hooks, &progress, kept)
                                          : runSharded(c, std::move(prepared.shards), hooks, &progress, kept);
  // Process 0 verifies, writes and reports, or every process verifies its part (docs/distributed.md).
  std::vector<Verdict> verdicts;
  if (verifyMode != VerifyMode::kNone && (jobProcess() == 0 || prepared.part)) {
    progress.phase("verify");
#if defined(__GLIBC__)
    // The ranks' freed memory stays resident (keepFreedMemory), in pieces between the kept results
    // that the reference's larger blocks do not fit in: handing it back first lowers a GTP_remat run's
    // peak by a fifth and makes it vary half as much from run to run (docs/memory.md).
    malloc_trim(0);
#endif
    verdicts = prepared.part ? verifyPart(c, prepared.partInputs, result, verifyMode)
                             : verify(c, inputs, result, verifyMode);
  }
  if (jobProcess() != 0) return 0;
  std::size_t collectives = 0, splits = 0;
  for (const auto& events : result.trace)
    for (const auto& e : events) ++(e.op == "split" ? splits : collectives);
  progress.above([&] {
    std::printf("# %d ranks issued %zu collectives (and %zu group splits)\n", c.tp * c.gtpRemat, collectives, splits);
  });

  bool ok = true;
  std::string notes;
  if (verifyMode != VerifyMode::kNone) {
    for (const Verdict& v : verdicts) {
      ok = ok && v.outside == 0;
      notes += outsideNote(v) + nonFiniteNote(v);
    }
    progress.above([&] {
      std::printf("\n");
      if (verifyMode == VerifyMode::kExact)
        std::printf("# --verify exact: every element must equal the unsharded result rounded to its dtype\n");
      std::fputs(verificationTable(verdicts).c_str(), stdout);
      if (!notes.empty()) std::printf("\n%s", notes.c_str());
    });
  }
  if (!saveDir.empty() || !saveCheckpoint.empty() || c.record) progress.phase("save");
  if (!saveDir.empty()) {
    save(saveDir, result, loadDir.empty() ? inputs : InputMap{});
    progress.above([&] { std::printf("\nsaved to %s\n", terminalText(saveDir).c_str()); });
  }
  if (!saveCheckpoint.empty()) {
    writer.commit(saveCheckpoint);
    progress.above([&] {
      const std::string shown = terminalText(saveCheckpoint);
      std::printf("\ncheckpoint saved to %s (tpsim checkpoint inspect %s)\n", shown.c_str(), shown.c_str());
    });
  }
  if (c.record) {
    writeTrace(trace, result.records, LayerGrid(c.tp, c.gtpRemat));
    progress.above([&] {
      std::printf("\ntrace (clock %s) written to %s\n", terminalText(trace.clockText()).c_str(),
                  terminalText(trace.file).c_str());
    });
  }
  const char* conclusion = verifyMode == VerifyMode::kNone    ? "verification skipped (--verify none)"
                           : !ok                               ? "MISMATCH"
                           : verifyMode == VerifyMode::kExact ? "sharded results equal the unsharded computation"
                                                               : "sharded results agree with the unsharded computation";
  progress.finish();
  std::printf("\n%s\n", conclusion);
  return ok ? 0 : 1;
}

}  // namespace tpsim::tools
