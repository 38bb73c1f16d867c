#include "tools/lib/layer_kind.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "backends/errors.h"
#include "backends/huge_pages.h"
#include "backends/stop.h"
#include "sim/host_pool.h"
#include "tools/lib/layers/kinds.h"

namespace tpsim::tools {
namespace {

std::string joinKinds(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i)
    s += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return s;
}

std::vector<std::int64_t> dimsOf(const RunConfig& c, const TensorSpec& t) {
  std::vector<std::int64_t> dims;
  for (const std::string& symbol : t.dims) dims.push_back(sizeValue(c, symbol));
  return dims;
}

// Where the tensor `name` is read from when it is one of the parameters a checkpoint holds.
std::optional<LayerKind::CheckpointSlot> checkpointSlotOf(const RunConfig& c, const std::string& name,
                                                          const SizeSources& sources) {
  if (!sources.checkpoint.empty())
    for (const TensorSpec& t : c.layer->tensors(c))
      if (t.name == name && t.role == TensorRole::kParameter) return c.layer->checkpointSlot(name);
  return std::nullopt;
}

// Whether size `s` is its flag's, not read from a file or a checkpoint key.
bool flagGives(const RunConfig& c, const SizeSpec& s, const SizeSources& sources) {
  return s.tensor.empty() || (!checkpointSlotOf(c, s.tensor, sources) && sources.inputs == SizeSources::Inputs::kFlags);
}

// A size as a message names it: the checkpoint key or the file it is read from, or its flag.
std::string sizeText(const RunConfig& c, const SizeSpec& s, const SizeSources& sources) {
  if (flagGives(c, s, sources)) return "--" + s.flag;
  if (const auto slot = checkpointSlotOf(c, s.tensor, sources))
    return detail::concat(s.description, " (checkpoint ", sources.checkpoint, ": key '", slot->key, "' dim ",
                          s.dim + (slot->index >= 0 ? 1 : 0), ")");
  return detail::concat(s.description, " (", s.tensor, ".npy dim ", s.dim, ")");
}

// A tensor as a message names it: the checkpoint key (and entry) it is read from, or its file.
std::string tensorText(const RunConfig& c, const std::string& name, const SizeSources& sources) {
  if (const auto slot = checkpointSlotOf(c, name, sources))
    return detail::concat("checkpoint ", sources.checkpoint, ": key '", slot->key, "'",
                          slot->index >= 0 ? detail::concat(" entry ", slot->index) : "");
  return name + ".npy";
}

std::string symbols(const std::vector<std::string>& dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i];
  return s + (dims.size() == 1 ? ",)" : ")");
}

}  // namespace

const std::vector<const LayerKind*>& layerKinds() {
  static const std::vector<const LayerKind*> table = {&columnLayerKind(),        &rowLayerKind(),
                                                      &embeddingLayerKind(),     &mlpLayerKind(),
                                                      &groupedColumnLayerKind(), &groupedRowLayerKind()};
  return table;
}

const LayerKind* findLayerKind(const std::string& name) {
  for (const LayerKind* k : layerKinds())
    if (name == k->name()) return k;
  return nullptr;
}

const LayerKind* layerKind(const std::string& name) {
  const LayerKind* k = findLayerKind(name);
  TPSIM_CHECK(k, "--layer: expected ", layerKindNames(), ", got '", name, "'");
  return k;
}

std::string layerKindNames() {
  std::vector<std::string> names;
  for (const LayerKind* k : layerKinds()) names.push_back(k->name());
  return joinKinds(names);
}

std::string layerKindsTaking(LayerOption option) {
  std::vector<std::string> names;
  for (const LayerKind* k : layerKinds())
    if (k->takes(option)) names.push_back(k->name());
  return joinKinds(names);
}

std::string layerKindsSizedBy(const std::string& flag) {
  std::vector<std::string> names;
  for (const LayerKind* k : layerKinds())
    if (std::any_of(k->sizes().begin(), k->sizes().end(), [&](const SizeSpec& s) { return s.flag == flag; }))
      names.push_back(k->name());
  return joinKinds(names);
}

std::string LayerKind::placementOf(const std::string& name) const {
  if (name == "input") return inputPlacement();
  if (name == "grad_output") return outputPlacement() + ".grad";
  return name;
}

DType LayerKind::wgradDtype(const RunConfig& c) const {
  // GTP_remat turns fusion off; its wgrad is computed in the wire dtype (core/linear.cc, core/embedding.cc).
  if (c.gtpRemat > 1) return gtpWireDtype(c);
  return c.gradAccumulationFusion ? c.mainGradDtype : c.dtype;  // the runner allocates main_grad (runner.cc)
}

const GtpWeightSpec* gtpWeightOf(const RunConfig& c, const std::string& name) {
  for (const GtpWeightSpec& w : c.layer->gtpWeights()) {
    if (w.name == name) return &w;
    const std::size_t each = w.name.find("<i>");
    if (each != std::string::npos && name.size() > each && name.compare(0, each, w.name, 0, each) == 0 &&
        name.find_first_not_of("0123456789", each) == std::string::npos)
      return &w;
  }
  return nullptr;
}

const SizeSpec& sizeNamed(const RunConfig& c, const std::string& symbol) {
  const std::vector<SizeSpec>& sizes = c.layer->sizes();
  for (const SizeSpec& s : sizes)
    if (s.symbol == symbol) return s;
  TPSIM_INTERNAL_ASSERT(false, c.layer->name(), " has no size ", symbol);
  return sizes.front();
}

std::int64_t sizeValue(const RunConfig& c, const std::string& symbol) { return c.*sizeNamed(c, symbol).field; }

ShapeMap tensorShapes(const RunConfig& c) {
  ShapeMap m;
  for (const TensorSpec& t : c.layer->tensors(c)) {
    // Every tensor's bytes as doubles checked once, so no product of these sizes can wrap later.
    std::string flags;
    for (const std::string& symbol : t.dims) flags += (flags.empty() ? "--" : " x --") + sizeNamed(c, symbol).flag;
    std::int64_t bytes = sizeof(double);
    const std::vector<std::int64_t> dims = dimsOf(c, t);
    for (std::int64_t d : dims) bytes = checkedMul(bytes, d, flags);
    m[t.name] = dims;
  }
  return m;
}

void drawNormals(std::mt19937_64& rng, double sigma, DType dtype, std::int64_t n, sim::HostPool* pool,
                 const std::function<void(std::int64_t, std::int64_t, const char*)>& piece,
                 const std::function<bool(std::int64_t, std::int64_t)>& wants) {
  // A block of pairs is drawn while the previous block's normals are computed and stored; a block
  // of 2^19 pairs (2^20 elements) is tens of milliseconds, a progress point.
  constexpr std::int64_t kBlockPairs = std::int64_t(1) << 19, kParts = 8;
  const StopFlag* stop = currentStopFlag();
  const std::size_t size = dtypeSize(dtype);
  const std::int64_t pairs = (n + 1) / 2, blocks = (pairs + kBlockPairs - 1) / kBlockPairs;
  // generate_canonical<double, 53> over a 64-bit engine: one draw over 2^64, kept below 1.
  auto uniform = [&rng] {
    const double u = double(rng() - std::mt19937_64::min()) / 18446744073709551616.0;
    return u >= 1.0 ? std::nextafter(1.0, 0.0) : u;
  };
  // The disc's points (x, y, r2) of the block's pairs, drawn in order.
  auto drawBlock = [&](std::int64_t block, std::vector<double>& disc) {
    const std::int64_t count = std::min(kBlockPairs, pairs - block * kBlockPairs);
    disc.resize(std::size_t(3 * count));
    for (std::int64_t i = 0; i < count; ++i) {
      double x, y, r2;
      do {
        x = 2.0 * uniform() - 1.0;
        y = 2.0 * uniform() - 1.0;
        r2 = x * x + y * y;
      } while (r2 > 1.0 || r2 == 0.0);
      disc[std::size_t(3 * i)] = x, disc[std::size_t(3 * i + 1)] = y, disc[std::size_t(3 * i + 2)] = r2;
    }
  };
  static_assert(2 * kBlockPairs == kInputPieceElements, "a block of pairs makes one piece");
  std::vector<char> out(std::size_t(std::min(n, kInputPieceElements)) * size);
  auto store = [&](std::int64_t at, double normal) {  // at: within the block's piece
    storeFromDouble(dtype, roundedTo(dtype, normal * sigma + 0.0), out.data() + std::size_t(at) * size);
  };
  std::vector<double> current, next;
  if (blocks > 0) drawBlock(0, current);
  for (std::int64_t b = 0; b < blocks; ++b) {
    throwIfStopped(stop, "tpsim run");
    const std::int64_t count = std::int64_t(current.size() / 3), first = 2 * b * kBlockPairs;
    const std::int64_t elements = std::min(kInputPieceElements, n - first);
    const bool wanted = !wants || wants(first, elements);
    // Task 0 draws the next block; the others turn parts of this one into normals.
    sim::runTasks(pool, 1 + (wanted ? kParts : 0), [&](std::int64_t task) {
      if (task == 0) {
        if (b + 1 < blocks) drawBlock(b + 1, next);
        return;
      }
      const std::int64_t begin = count * (task - 1) / kParts, end = count * task / kParts;
      for (std::int64_t i = begin; i < end; ++i) {
        const double x = current[std::size_t(3 * i)], y = current[std::size_t(3 * i + 1)],
                     r2 = current[std::size_t(3 * i + 2)];
        const double mult = std::sqrt(-2 * std::log(r2) / r2);
        // The pair's second normal is what the distribution keeps for its next call.
        store(2 * i, y * mult);
        if (first + 2 * i + 1 < n) store(2 * i + 1, x * mult);
      }
    });
    if (wanted) piece(first, elements, out.data());
    current.swap(next);
  }
}

void WholeInputs::begin(const std::string& name, const TensorHeader& header) {
  name_ = name;
  tensor_ = StoredTensor{header.shape, header.dtype, {}};
  resizeFresh(tensor_.bytes, std::size_t(tensor_.numel()) * dtypeSize(header.dtype));
}

void WholeInputs::piece(std::int64_t offset, std::int64_t count, const char* bytes) {
  const std::size_t size = dtypeSize(tensor_.dtype);
  std::memcpy(tensor_.bytes.data() + std::size_t(offset) * size, bytes, std::size_t(count) * size);
}

void WholeInputs::end() { take_(name_, std::move(tensor_)); }

void sendWhole(const std::string& name, const StoredTensor& tensor, InputSink& sink) {
  sink.begin(name, {tensor.shape, tensor.dtype});
  sink.piece(0, tensor.numel(), tensor.bytes.data());
  sink.end();
}

InputMap generateInputs(const RunConfig& c) {
  InputMap m;
  WholeInputs sink([&m](const std::string& name, StoredTensor t) { m[name] = std::move(t); });
  generateInputs(c, sink);
  return m;
}

void generateInputs(const RunConfig& c, InputSink& sink) {
  const ShapeMap shapes = tensorShapes(c);
  std::mt19937_64 rng(c.seed);
  const StopFlag* stop = currentStopFlag();
  // Helpers for the large tensors' normals, joined before this returns: a run leaves no thread behind.
  const bool large = std::any_of(shapes.begin(), shapes.end(), [](const auto& entry) {
    std::int64_t n = 1;
    for (std::int64_t d : entry.second) n *= d;
    return n >= (std::int64_t(1) << 16);
  });
  std::optional<sim::HostPool> pool;
  if (large) pool.emplace(std::max(0, int(std::thread::hardware_concurrency()) - 1));
  // The draws keep the kind's order, so a seed makes the same data.
  for (const TensorSpec& t : c.layer->tensors(c)) {
    const TensorHeader header{shapes.at(t.name), t.idRange.empty() ? c.dtype : DType::kInt64};
    std::int64_t n = 1;
    for (std::int64_t d : header.shape) n *= d;
    sink.begin(t.name, header);
    if (t.idRange.empty()) {
      drawNormals(
          rng, t.sigma, header.dtype, n, pool ? &*pool : nullptr,
          [&sink](std::int64_t offset, std::int64_t count, const char* bytes) { sink.piece(offset, count, bytes); },
          [&sink](std::int64_t offset, std::int64_t count) { return sink.wants(offset, count); });
      sink.end();
      continue;
    }
    // Token ids: few, in order, a piece at a time between stop checks.
    std::uniform_int_distribution<std::int64_t> id(0, sizeValue(c, t.idRange) - 1);
    const std::size_t size = dtypeSize(header.dtype);
    std::vector<char> piece(std::size_t(std::min(n, kInputPieceElements)) * size);
    for (std::int64_t first = 0; first < n; first += kInputPieceElements) {
      throwIfStopped(stop, "tpsim run");
      const std::int64_t count = std::min(kInputPieceElements, n - first);
      for (std::int64_t i = 0; i < count; ++i) storeFromDouble(header.dtype, double(id(rng)), piece.data() + i * size);
      sink.piece(first, count, piece.data());
    }
    sink.end();
  }
}

RunConfig withSizesOf(RunConfig c, const ShapeMap& shapes) {
  for (const SizeSpec& s : c.layer->sizes()) {
    auto it = shapes.find(s.tensor);
    if (it != shapes.end() && std::size_t(s.dim) < it->second.size()) c.*s.field = it->second[std::size_t(s.dim)];
  }
  return c;
}

void checkSizes(const RunConfig& c, const SizeSources& sources) {
  const std::string prefix = sources.inputs == SizeSources::Inputs::kFiles ? "tpsim run: " : "";
  auto divisible = [&](const std::string& what, std::int64_t v, std::int64_t by, const std::string& why) {
    TPSIM_CHECK(v % by == 0, prefix, what, " = ", v, " must be divisible by ", why, " = ", by);
  };
  using D = SizeSpec::Divisor;
  const std::vector<SizeSpec>& sizes = c.layer->sizes();
  // The splits of the activations first, then the TP cuts of the weights, then GTP_remat's.
  const bool sequenceSplit = c.sequenceParallel || c.reduceScatterEmbeddings;
  for (const SizeSpec& s : sizes)
    if (s.divisor == D::kSequenceSplit && sequenceSplit) divisible(sizeText(c, s, sources), c.*s.field, c.tp, "--tp");
  for (const SizeSpec& s : sizes)
    if (s.divisor == D::kGtpRemat) divisible(sizeText(c, s, sources), c.*s.field, c.gtpRemat, "--gtp-remat");
  for (const SizeSpec& s : sizes) {
    if (s.divisor == D::kTp) divisible(sizeText(c, s, sources), c.*s.field, c.tp, "--tp");
    if (s.divisor == D::kTpStride)
      divisible(sizeText(c, s, sources), c.*s.field, std::int64_t(c.tp) * c.stride, "--tp x --stride");
  }
  // Each GTP_remat peer keeps dim 0 / G rows of a TP-local weight when nothing pads it.
  if (c.gtpRemat > 1 && c.padForAlignment == 0)
    for (const GtpWeightSpec& w : c.layer->gtpWeights())
      divisible(detail::concat(w.name, w.tpCutsDim0 ? "'s TP-local rows, " : "'s rows, ",
                               sizeText(c, sizeNamed(c, w.symbol), sources), w.tpCutsDim0 ? " / --tp" : ""),
                sizeValue(c, w.symbol) / (w.tpCutsDim0 ? c.tp : 1), c.gtpRemat, "--gtp-remat (with --pad-for-alignment 0)");
}

void checkGivenSizes(const RunConfig& given, const std::set<std::string>& givenFlags, const RunConfig& sized,
                     const SizeSources& sources) {
  for (const SizeSpec& s : sized.layer->sizes()) {
    if (!givenFlags.count(s.flag) || flagGives(sized, s, sources)) continue;
    TPSIM_CHECK(given.*s.field == sized.*s.field, "--", s.flag, ": expected ", sized.*s.field, " (as ",
                sizeText(sized, s, sources), " gives it) or no --", s.flag, ", got ", given.*s.field);
  }
}

HeaderMap headersOf(const InputMap& in) {
  HeaderMap m;
  for (const auto& [name, t] : in) m[name] = {t.shape, t.dtype};
  return m;
}

RunConfig checkInputHeaders(const RunConfig& c, const HeaderMap& in, const SizeSources& sources) {
  // Empty tensors are refused: the layers and the reference divide by these sizes.
  for (const auto& [name, t] : in)
    TPSIM_CHECK(std::all_of(t.shape.begin(), t.shape.end(), [](std::int64_t d) { return d >= 1; }), "tpsim run: ",
                tensorText(c, name, sources), ": expected every dim >= 1, got shape ", shapeText(t.shape));
  const std::vector<TensorSpec> specs = c.layer->tensors(c);
  for (const TensorSpec& t : specs) TPSIM_CHECK(in.count(t.name), "tpsim run: ", t.name, ".npy is missing");
  // The tensors the sizes are read from must be what they hold before their dims are believed.
  const std::vector<SizeSpec>& sizes = c.layer->sizes();
  for (const TensorSpec& t : specs) {
    if (std::none_of(sizes.begin(), sizes.end(), [&](const SizeSpec& s) { return s.tensor == t.name; })) continue;
    const TensorHeader& x = in.at(t.name);
    const bool rankOk = x.shape.size() == t.dims.size();
    if (t.idRange.empty())
      TPSIM_CHECK(rankOk && isFloating(x.dtype), "tpsim run: ", t.name, ".npy must be a float ", symbols(t.dims),
                  " tensor, got ", dtypeName(x.dtype), " ", shapeText(x.shape));
    else
      TPSIM_CHECK(rankOk && x.dtype == DType::kInt64, "tpsim run: ", t.name, ".npy must hold int64 token ids of "
                  "shape ", symbols(t.dims), ", got ", dtypeName(x.dtype), " ", shapeText(x.shape));
  }
  ShapeMap shapes;
  for (const auto& [name, t] : in) shapes[name] = t.shape;
  const RunConfig sized = withSizesOf(c, shapes);
  for (const TensorSpec& t : specs) {
    const std::vector<std::int64_t> want = dimsOf(sized, t), got = in.at(t.name).shape;
    TPSIM_CHECK(got == want, "tpsim run: ", t.name, ".npy must have shape ", shapeText(want), ", got ", shapeText(got));
  }
  checkSizes(sized, sources);
  return sized;
}

void CheckedInputs::begin(const std::string& name, const TensorHeader& header) {
  // What was read of a file's header sized the run; a file changed since is refused before any
  // shard is cut by the sizes it had.
  const std::vector<TensorSpec> specs = sized_.layer->tensors(sized_);
  const auto spec = std::find_if(specs.begin(), specs.end(), [&](const TensorSpec& t) { return t.name == name; });
  TPSIM_INTERNAL_ASSERT(spec != specs.end(), sized_.layer->name(), " has no tensor ", name);
  const std::vector<std::int64_t> want = dimsOf(sized_, *spec);
  const DType wantDtype = spec->idRange.empty() ? sized_.dtype : DType::kInt64;
  TPSIM_CHECK(header.shape == want && header.dtype == wantDtype, "tpsim run: ", tensorText(sized_, name, sources_),
              ": expected ", dtypeName(wantDtype), " ", shapeText(want), " as its header said, got ",
              dtypeName(header.dtype), " ", shapeText(header.shape), " (it changed while the run read it)");
  name_ = name;
  dtype_ = header.dtype;
  idSymbol_ = spec->idRange;
  idRange_ = idSymbol_.empty() ? 0 : sizeValue(sized_, idSymbol_);
  nonFinite_ = 0, firstNonFinite_ = -1;
  next_.begin(name, header);
}

void CheckedInputs::piece(std::int64_t offset, std::int64_t count, const char* bytes) {
  const std::size_t size = dtypeSize(dtype_);
  // Non-finite inputs would only surface as a result outside its bound.
  auto countNonFinite = [&](std::int64_t i, double v) {
    if (!std::isfinite(v) && nonFinite_++ == 0) firstNonFinite_ = offset + i;
  };
  if (dtype_ == DType::kFloat32) {  // the common case, a pass the compiler vectorizes
    std::int64_t bad = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      float f;
      std::memcpy(&f, bytes + std::size_t(i) * 4, 4);
      bad += !std::isfinite(f);
    }
    if (bad > 0)
      for (std::int64_t i = 0; i < count; ++i) countNonFinite(i, loadAsDouble(dtype_, bytes + std::size_t(i) * 4));
  } else {
    for (std::int64_t i = 0; i < count; ++i) {
      const double v = loadAsDouble(dtype_, bytes + std::size_t(i) * size);
      countNonFinite(i, v);
      TPSIM_CHECK(idSymbol_.empty() || (v >= 0 && v < double(idRange_)), "tpsim run: ", name_, ".npy holds id ",
                  std::int64_t(v), " at flat position ", offset + i, ", outside [0, ", idSymbol_, "=", idRange_, ")");
    }
  }
  next_.piece(offset, count, bytes);
}

void CheckedInputs::end() {
  TPSIM_CHECK(nonFinite_ == 0, "tpsim run: ", tensorText(sized_, name_, sources_), ": expected finite values, got ",
              nonFinite_, " NaN or Inf, the first at flat index ", firstNonFinite_);
  next_.end();
}

namespace {

class NoInputs : public InputSink {
 public:
  void begin(const std::string&, const TensorHeader&) override {}
  void piece(std::int64_t, std::int64_t, const char*) override {}
  void end() override {}
};

}  // namespace

void checkInputValues(const RunConfig& sized, const std::string& name, const StoredTensor& t,
                      const SizeSources& sources) {
  NoInputs none;
  CheckedInputs checked(sized, sources, none);
  sendWhole(name, t, checked);
}

void checkInputs(const RunConfig& c, const InputMap& in, const SizeSources& sources) {
  const RunConfig sized = checkInputHeaders(c, headersOf(in), sources);
  // In the kind's order, as a run that holds one tensor at a time meets them.
  for (const TensorSpec& t : sized.layer->tensors(sized)) checkInputValues(sized, t.name, in.at(t.name), sources);
}

}  // namespace tpsim::tools
