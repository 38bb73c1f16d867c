// The Python module `tpsim`: `tpsim run`, `tpsim layout` and `tpsim checkpoint` as functions, numpy
// arrays in and out.
//
// Keyword arguments are the commands' flags (tp=4 is --tp 4, sequence_parallel=True is
// --sequence-parallel), parsed by the CLI's own parsers, so that a value the CLI refuses raises
// ValueError with the CLI's message. Tensors travel as arrays instead of files: no --load, --save,
// checkpoint or trace flags in tpsim.run (tpsim.checkpoint.load's arrays are its inputs). A failed
// rank raises tpsim.RankFailure; Ctrl-C stops a run within a fraction of a second and raises
// KeyboardInterrupt. Not here: the GPU backend's tests.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <boost/program_options/errors.hpp>
#include <csignal>
#include <cstdio>
#include <map>
#include <new>
#include <set>
#include <string>
#include <vector>

#include "backends/errors.h"
#include "backends/stop.h"
#include "backends/world.h"
#include "core/placement.h"
#include "core/rank_grid.h"
#include "tools/cli/cli.h"
#include "tools/lib/layout.h"
#include "tools/lib/memory.h"
#include "tools/lib/npy.h"
#include "tools/lib/runner.h"

namespace py = pybind11;

namespace tpsim::tools {
namespace {

// tpsim.RankFailure, owned by the module.
PyObject* rankFailure = nullptr;

// The command lines' flags that have no keyword: those naming files (tensors are arrays here), and
// help (Python's help() shows the docstring).
const std::set<std::string> kRunFileFlags = {"help", "load", "save", "load_checkpoint", "save_checkpoint",
                                             "trace", "clock", "device_model"};
const std::set<std::string> kLayoutFileFlags = {"help", "svg"};

// kwargs as the command line the CLI would parse: True -> --flag, False and None -> left out, a list
// -> the flag once per item (inject), anything else -> --flag=str(value).
std::vector<std::string> commandLineOf(const char* function, const py::kwargs& kwargs,
                                       const std::set<std::string>& refused) {
  std::vector<std::string> args;
  for (const auto& [key, value] : kwargs) {
    std::string name = py::str(key);
    if (refused.count(name))
      throw py::value_error(std::string(function) + ": " + name + " is the command line's only: here tensors are " +
                            "numpy arrays (inputs=, the result's arrays), and help is help(" + function + ")");
    for (char& ch : name)
      if (ch == '_') ch = '-';
    const std::string flag = "--" + name;
    if (value.is_none()) continue;
    if (py::isinstance<py::bool_>(value)) {
      if (value.cast<bool>()) args.push_back(flag);
    } else if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
      for (const py::handle item : value) args.push_back(flag + "=" + std::string(py::str(item)));
    } else {
      args.push_back(flag + "=" + std::string(py::str(value)));
    }
  }
  return args;
}

// Ctrl-C during a run. With the GIL released, Python's SIGINT handler only notes the signal for the
// main thread to act on once the run returns; this handler, put in front of it for the run, also
// sets the run's stop flag, so that the world stops at its next progress point and the run returns
// at once (Stopped), to raise the KeyboardInterrupt Python's handler then raises. The flag is static:
// a handler still running on another thread as the run ends never writes to a flag that is gone.
StopFlag sigintStop{false};
struct sigaction pythonSigint;  // Python's C-level handler, which this one calls on

extern "C" void stopOnSigint(int signal, siginfo_t* info, void* context) {
  sigintStop.store(true);
  if (pythonSigint.sa_flags & SA_SIGINFO) pythonSigint.sa_sigaction(signal, info, context);
  else if (pythonSigint.sa_handler != SIG_DFL && pythonSigint.sa_handler != SIG_IGN) pythonSigint.sa_handler(signal);
}

// For its lifetime, SIGINT sets flag(): on Python's main thread (the only one that Python raises
// KeyboardInterrupt in, so runs there never overlap) and only where SIGINT raises it, under Python's
// default handler. Elsewhere flag() is null, and a run ends as it would have.
class SigintStops {
 public:
  SigintStops() {
    const py::module_ threading = py::module_::import("threading"), signal = py::module_::import("signal");
    if (!threading.attr("current_thread")().is(threading.attr("main_thread")()) ||
        !signal.attr("getsignal")(SIGINT).is(signal.attr("default_int_handler")))
      return;
    struct sigaction mine {};
    mine.sa_sigaction = stopOnSigint;
    mine.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&mine.sa_mask);
    sigintStop.store(false);
    installed_ = ::sigaction(SIGINT, &mine, &pythonSigint) == 0;
  }
  ~SigintStops() {
    if (installed_) ::sigaction(SIGINT, &pythonSigint, nullptr);
  }
  SigintStops(const SigintStops&) = delete;
  SigintStops& operator=(const SigintStops&) = delete;

  const StopFlag* flag() const { return installed_ ? &sigintStop : nullptr; }

 private:
  bool installed_ = false;
};

// Runs `body`, turning the library's errors into Python's as the CLI turns them into messages
// (tools/cli/main.cc): the same text, less the "tpsim COMMAND: " the CLI puts before it.
template <class Body>
auto translated(const std::string& command, Body&& body) -> decltype(body()) {
  const std::string prefix = "tpsim " + command + ": ";
  const auto unprefixed = [&](std::string message) {
    if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
    return message;
  };
  try {
    return body();
  } catch (const Stopped&) {
    // Python's handler noted the signal: running it now raises KeyboardInterrupt.
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    PyErr_SetString(PyExc_KeyboardInterrupt, ("tpsim " + command + ": stopped").c_str());
    throw py::error_already_set();
  } catch (const UsageError& e) {
    throw py::value_error(e.message);
  } catch (const boost::program_options::error& e) {
    throw py::value_error(e.what());
  } catch (const WorldError& e) {
    py::object error = py::reinterpret_borrow<py::object>(rankFailure)("the simulated world failed: " +
                                                                       unprefixed(e.what()));
    error.attr("rank_errors") = py::cast(e.rankErrors());
    PyErr_SetObject(rankFailure, error.ptr());
    throw py::error_already_set();
  } catch (const InvalidArgument& e) {
    throw py::value_error(unprefixed(e.what()));
  } catch (const std::bad_alloc&) {
    PyErr_SetString(PyExc_MemoryError, ("tpsim " + command + ": out of memory").c_str());
    throw py::error_already_set();
  }
}

// An array of the host tensor's values: float32 as --save writes them (every dtype's values are
// exact in it), int64 for token ids.
py::array arrayOf(const HostTensor& t) {
  const std::vector<py::ssize_t> shape(t.shape.begin(), t.shape.end());
  if (t.dtype == DType::kInt64) {
    py::array_t<std::int64_t> a(shape);
    std::int64_t* out = a.mutable_data();
    for (std::size_t i = 0; i < t.values.size(); ++i) out[i] = std::int64_t(t.values[i]);
    return std::move(a);
  }
  py::array_t<float> a(shape);
  float* out = a.mutable_data();
  for (std::size_t i = 0; i < t.values.size(); ++i) out[i] = float(t.values[i]);
  return std::move(a);
}

py::array arrayOf(const StoredTensor& t) { return arrayOf(hostOf(t)); }

template <class Tensors>
py::dict arraysOf(const Tensors& tensors) {
  py::dict out;
  for (const auto& [name, t] : tensors) out[py::str(name)] = arrayOf(t);
  return out;
}

// The array's element type as the .npy reader names it; throws ValueError naming `where` otherwise.
DType dtypeOf(const py::array& a, const std::string& where) {
  if (py::isinstance<py::array_t<float>>(a)) return DType::kFloat32;
  if (py::isinstance<py::array_t<double>>(a)) return DType::kFloat64;
  if (py::isinstance<py::array_t<std::int64_t>>(a)) return DType::kInt64;
  if (a.dtype().kind() == 'f' && a.itemsize() == 2 && a.dtype().attr("isnative").cast<bool>())
    return DType::kFloat16;
  throw py::value_error(where + ": expected a float32, float64, float16 or int64 array, got " +
                        std::string(py::str(a.dtype())));
}

// The caller's arrays as the run's tensors, each through the conversion --load's files take, once
// their shapes have passed the memory check. Every tensor of the layer must be there, and nothing else.
InputMap tensorsOf(const RunArgs& parsed, const py::dict& arrays) {
  const RunConfig& c = parsed.config;
  const std::vector<TensorSpec> specs = c.layer->tensors(c);
  std::string names;
  for (const TensorSpec& t : specs) names += (names.empty() ? "" : ", ") + t.name;
  const std::string reads = "; --layer " + std::string(c.layer->name()) + " reads " + names;
  for (const auto& [key, value] : arrays) {
    const std::string name = py::str(key);
    if (std::none_of(specs.begin(), specs.end(), [&](const TensorSpec& t) { return t.name == name; }))
      throw py::value_error("inputs: unexpected '" + name + "'" + reads);
  }
  std::vector<py::array> held;  // C-contiguous, in specs' order
  std::vector<DType> dtypes;
  ShapeMap shapes;
  for (const TensorSpec& t : specs) {
    if (!arrays.contains(t.name)) throw py::value_error("inputs: expected '" + t.name + "'" + reads);
    const std::string where = "inputs['" + t.name + "']";
    held.push_back(py::array::ensure(arrays[py::str(t.name)], py::array::c_style));
    if (!held.back()) throw py::value_error(where + ": expected an array");
    dtypes.push_back(dtypeOf(held.back(), where));
    shapes[t.name] = std::vector<std::int64_t>(held.back().shape(), held.back().shape() + held.back().ndim());
  }
  checkMemory(c, shapes, parsed.verify, parsed.maxMemory, "inputs");
  InputMap out;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& t = specs[i];
    out[t.name] = storedTensorOf(dtypes[i], shapes.at(t.name), held[i].data(),
                                 t.idRange.empty() ? c.dtype : DType::kInt64, "inputs['" + t.name + "']");
  }
  return out;
}

// Each tensor's placement, then the block each rank (t, g) holds: the layout as text, without the
// drawing.
std::string placementsText(const RunConfig& c, const std::vector<TensorPlacement>& placements) {
  const LayerGrid grid(c.tp, c.gtpRemat);
  std::string text;
  for (const TensorPlacement& p : placements) {
    text += p.name + " " + shapeText(p.shape) + ": " + placementText(p) + "\n";
    for (int rank = 0; rank < grid.size(); ++rank) {
      const int t = grid.t(rank), g = grid.g(rank);
      text += "  r" + std::to_string(rank) + " (t=" + std::to_string(t) + ", g=" + std::to_string(g) + ") " +
              shapeText(localShape(p, t, g)) + ": " + holdsText(p, t, g) + "\n";
    }
  }
  return text;
}

struct PyRunResult {
  std::string config;      // RunConfig::str(): the line `tpsim run` prints first
  py::dict inputs;         // as the run used them: generated or converted, rounded to the dtype
  py::dict results;        // unsharded outputs and gradients
  std::vector<std::vector<TraceEvent>> collectives;  // per rank, in the order it issued them
  std::vector<Verdict> verification;
  std::string placements;
  bool ok = true;
  // Per rank r = t + T·g: (t, g); name -> its block of every input as the placements
  // (core/placement.h) cut it, pad rows zero, and its own results; parameter ->
  // gtp_local_pad_zero_count; parameter -> whether the duplicate filters count its copy.
  std::vector<std::pair<int, int>> ranks;
  std::vector<py::dict> shards;
  std::vector<std::map<std::string, std::int64_t>> padZeroCounts;
  std::vector<std::map<std::string, bool>> counted;
};

// What each rank holds of the run's inputs and results, its pad counts and duplicate filters' choices.
void addRankViews(const RunConfig& c, const InputMap& inputs, const RunResult& result, PyRunResult& out) {
  const LayerGrid grid(c.tp, c.gtpRemat);
  for (int rank = 0; rank < grid.size(); ++rank) {
    const int t = grid.t(rank), g = grid.g(rank);
    py::dict shards;
    for (const auto& [name, tensor] : inputs)
      shards[py::str(name)] = arrayOf(shardOf(placementNamed(result.placements, c.layer->placementOf(name)), tensor, t, g));
    for (const auto& [name, sharded] : result.sharded) shards[py::str(name)] = arrayOf(hostOf(sharded.local(t, g)));
    std::map<std::string, std::int64_t> pads;
    std::map<std::string, bool> counted;
    for (const TensorPlacement& p : result.placements)
      if (p.role == TensorRole::kParameter) {
        pads[p.name] = padZeroCount(p, t, g);
        counted[p.name] = p.countedOn(t, g);
      }
    out.ranks.emplace_back(t, g);
    out.shards.push_back(std::move(shards));
    out.padZeroCounts.push_back(std::move(pads));
    out.counted.push_back(std::move(counted));
  }
}

PyRunResult run(const py::kwargs& kwargs) {
  return translated("run", [&] {
    py::kwargs flags;
    py::object arrays = py::none();
    for (const auto& [key, value] : kwargs) {
      if (std::string(py::str(key)) == "inputs") arrays = py::reinterpret_borrow<py::object>(value);
      else flags[key] = value;
    }
    const RunArgs parsed = parseRunArgs(commandLineOf("tpsim.run", flags, kRunFileFlags));
    const RunConfig& c = parsed.config;
    const SigintStops sigint;
    const StopScope stopScope(sigint.flag());
    InputMap inputs;
    if (arrays.is_none()) {
      checkSizes(c, {SizeSources::Inputs::kFlags, ""});
      checkMemory(c, tensorShapes(c), parsed.verify, parsed.maxMemory, "");
      py::gil_scoped_release unlocked;
      inputs = generateInputs(c);
    } else {
      if (!py::isinstance<py::dict>(arrays))
        throw py::value_error("inputs: expected a dict of numpy arrays by name, got " +
                              std::string(py::str(arrays.get_type().attr("__name__"))));
      inputs = tensorsOf(parsed, arrays.cast<py::dict>());
      checkInputs(c, inputs, {SizeSources::Inputs::kFiles, ""});
    }
    PyRunResult out;
    RunResult result;
    {
      py::gil_scoped_release unlocked;
      result = runSharded(c, inputs);
      out.verification = verify(c, inputs, result, parsed.verify);
    }
    for (const Verdict& v : out.verification) out.ok = out.ok && v.outside == 0;
    out.config = c.str();
    out.inputs = arraysOf(inputs);
    out.results = arraysOf(result.results);
    for (const std::vector<TraceEvent>& events : result.trace) {  // the group splits are no collectives
      out.collectives.emplace_back();
      for (const TraceEvent& e : events)
        if (e.op != "split") out.collectives.back().push_back(e);
    }
    out.placements = placementsText(c, result.placements);
    addRankViews(c, inputs, result, out);
    return out;
  });
}

struct PyLayout {
  std::string text, svg;
};

PyLayout layout(const py::kwargs& kwargs) {
  return translated("layout", [&] {
    const LayoutArgs parsed = parseLayoutArgs(commandLineOf("tpsim.layout", kwargs, kLayoutFileFlags));
    const std::vector<TensorPlacement> placements = layoutPlacements(parsed.config);
    return PyLayout{layoutText(parsed.config, placements, false), layoutSvg(parsed.config, placements)};
  });
}

// A path argument as a string: str or os.PathLike; ValueError naming `name` otherwise.
std::string pathArgument(const char* function, const char* name, const py::object& value) {
  const py::module_ os = py::module_::import("os");
  if (py::isinstance<py::str>(value) || py::hasattr(value, "__fspath__")) {
    const py::object path = os.attr("fspath")(value);
    if (py::isinstance<py::str>(path)) return path.cast<std::string>();
  }
  throw py::value_error(std::string(function) + ": " + name + ": expected a str or os.PathLike, got " +
                        std::string(py::str(value.get_type().attr("__name__"))));
}

// What tpsim.checkpoint.inspect returns: `tpsim checkpoint inspect`'s report, and its table as data.
struct PyCheckpoint {
  std::string text, layer;
  py::dict keys, objects;
};

PyCheckpoint inspectCheckpoint(const py::object& path) {
  const std::string dir = pathArgument("tpsim.checkpoint.inspect", "path", path);
  return translated("checkpoint", [&] {
    const CheckpointArgs parsed = parseCheckpointArgs({"inspect", dir});
    PyCheckpoint out;
    {
      py::gil_scoped_release unlocked;
      const CheckpointReader reader(parsed.dir);
      out.text = inspectText(parsed.dir, reader);
      out.layer = reader.layer();
      py::gil_scoped_acquire locked;
      for (const auto& [key, k] : reader.keys()) {
        std::set<int> writers;
        for (const CheckpointChunk& c : k.chunks) writers.insert(c.writer);
        out.keys[py::str(key)] = py::dict(
            py::arg("dtype") = dtypeName(k.dtype), py::arg("global_shape") = py::tuple(py::cast(k.globalShape)),
            py::arg("saved_shape") = py::tuple(py::cast(k.savedGlobalShape)), py::arg("chunks") = k.chunks.size(),
            py::arg("writers") = std::vector<int>(writers.begin(), writers.end()),
            py::arg("padding") = checkpointPaddingText(k), py::arg("placement") = k.placement);
      }
      for (const auto& [key, o] : reader.objects()) {
        const std::set<int> writers(o.writers.begin(), o.writers.end());
        out.objects[py::str(key)] =
            py::dict(py::arg("global_shape") = py::tuple(py::cast(o.globalShape)),
                     py::arg("writers") = std::vector<int>(writers.begin(), writers.end()));
      }
    }
    return out;
  });
}

// Every tensor of the checkpoint, whole (pad rows dropped): the values consolidate writes, as arrays
// (float32, in which the saved dtypes' values are exact; int64 as int64).
py::dict loadCheckpoint(const py::object& path) {
  const std::string dir = pathArgument("tpsim.checkpoint.load", "path", path);
  return translated("checkpoint", [&] {
    const CheckpointArgs parsed = parseCheckpointArgs({"inspect", dir});
    TensorMap tensors;
    {
      py::gil_scoped_release unlocked;
      CheckpointIndex index(parsed.dir);
      index.checkFitsInMemory("tpsim.checkpoint.load");
      const CheckpointReader reader(std::move(index));
      for (const auto& [key, k] : reader.keys()) {
        const std::vector<char> bytes = reader.consolidated(key);
        std::vector<double> values(bytes.size() / dtypeSize(k.dtype));
        for (std::size_t i = 0; i < values.size(); ++i) values[i] = loadAsDouble(k.dtype, bytes.data() + i * dtypeSize(k.dtype));
        tensors[key] = makeHost(k.globalShape, k.dtype, std::move(values));
      }
    }
    return arraysOf(tensors);
  });
}

std::string consolidateCheckpointTo(const py::object& path, const py::object& file, const py::object& dtype) {
  const std::string dir = pathArgument("tpsim.checkpoint.consolidate", "path", path);
  const std::string out = pathArgument("tpsim.checkpoint.consolidate", "file", file);
  if (!py::isinstance<py::str>(dtype))
    throw py::value_error("tpsim.checkpoint.consolidate: dtype: expected 'saved', 'fp32', 'bf16' or 'fp16', got " +
                          std::string(py::repr(dtype)));
  return translated("checkpoint", [&] {
    const CheckpointArgs parsed = parseCheckpointArgs({"consolidate", dir, out, "--dtype", dtype.cast<std::string>()});
    py::gil_scoped_release unlocked;
    return consolidateCheckpoint(parsed.dir, parsed.file, parsed.to);
  });
}

}  // namespace
}  // namespace tpsim::tools

PYBIND11_MODULE(tpsim, m) {
  using namespace tpsim;
  using namespace tpsim::tools;
  m.doc() = "tpsim: Megatron-Core's tensor-parallel layers on simulated ranks, numpy arrays in and out";

  rankFailure = PyErr_NewExceptionWithDoc(
      "tpsim.RankFailure",
      "A rank of the simulated world failed (an injected fault, a collective mismatch, a timeout). "
      "rank_errors[r] is rank r's diagnostic, '' where it returned normally.",
      PyExc_RuntimeError, nullptr);
  m.attr("RankFailure") = py::reinterpret_steal<py::object>(rankFailure);

  py::class_<TraceEvent>(m, "Collective", "One collective a rank issued")
      .def_readonly("op", &TraceEvent::op)
      .def_readonly("group", &TraceEvent::group)
      .def_readonly("seq", &TraceEvent::seq)
      .def_readonly("dtype", &TraceEvent::dtype)
      .def_readonly("bytes", &TraceEvent::bytes, "bytes this rank sent")
      .def("__repr__", [](const TraceEvent& e) { return e.op + " " + e.group + " " + std::to_string(e.bytes) + "B"; });

  py::class_<Verdict>(m, "Verdict", "A row of the verification table: the result against the unsharded fp64 "
                                    "computation")
      .def_readonly("tensor", &Verdict::name)
      .def_readonly("shape", &Verdict::shape)
      .def_readonly("max_err", &Verdict::maxError)
      .def_readonly("bound", &Verdict::maxBound)
      .def_readonly("slack", &Verdict::slack)
      .def_readonly("outside", &Verdict::outside, "elements beyond their bound")
      .def_readonly("non_finite", &Verdict::nonFinite, "NaN or Inf elements")
      .def_property_readonly("ok", [](const Verdict& v) { return v.outside == 0; })
      .def_property_readonly("result", &verdictResult, "OK, FAIL or NON-FINITE")
      .def_property_readonly("note", [](const Verdict& v) { return outsideNote(v) + nonFiniteNote(v); })
      .def("__repr__", [](const Verdict& v) {
        char numbers[96];
        std::snprintf(numbers, sizeof numbers, " max_err=%.3e bound=%.3e outside=%lld ", v.maxError, v.maxBound,
                      (long long)v.outside);
        return "<Verdict " + v.name + " " + v.shape + numbers + verdictResult(v) + ">";
      });

  py::class_<PyRunResult>(m, "RunResult", "What tpsim.run returns")
      .def_readonly("config", &PyRunResult::config, "the effective configuration, as tpsim run prints it")
      .def_readonly("inputs", &PyRunResult::inputs, "name -> array: the tensors the run read, in its dtype")
      .def_readonly("results", &PyRunResult::results, "name -> array: unsharded output and gradients")
      .def_readonly("collectives", &PyRunResult::collectives, "per rank, every collective it issued, in order")
      .def_readonly("verification", &PyRunResult::verification, "one Verdict per result; empty for verify='none'")
      .def_readonly("placements", &PyRunResult::placements, "each tensor's placement and every rank's block")
      .def_readonly("ok", &PyRunResult::ok, "every result within its bound")
      .def_readonly("ranks", &PyRunResult::ranks, "per rank r = t + T*g: (t, g)")
      .def_readonly("shards", &PyRunResult::shards,
                    "per rank: name -> the rank's block of every input (pad rows zero) and its own results")
      .def_readonly("pad_zero_counts", &PyRunResult::padZeroCounts,
                    "per rank: parameter -> gtp_local_pad_zero_count, its elements that are GTP_remat padding")
      .def_readonly("counted", &PyRunResult::counted,
                    "per rank: parameter -> whether Megatron's duplicate filters count the rank's copy")
      .def("__str__", [](const PyRunResult& r) {
        if (r.verification.empty()) return "# tpsim run: " + r.config + "\nverification skipped (verify='none')";
        std::string notes;
        for (const Verdict& v : r.verification) notes += outsideNote(v) + nonFiniteNote(v);
        std::string text = "# tpsim run: " + r.config + "\n" + verificationTable(r.verification) +
                           (notes.empty() ? "" : "\n" + notes);
        text.pop_back();  // print() ends the line
        return text;
      })
      .def("__repr__", [](const PyRunResult& r) {
        std::string names;
        for (const auto& [name, a] : r.results) names += (names.empty() ? "" : ", ") + std::string(py::str(name));
        return "<tpsim.RunResult " + r.config + ": " + names + "; " +
               (r.verification.empty() ? "not verified" : r.ok ? "verified OK" : "MISMATCH") + ">";
      });

  py::class_<PyLayout>(m, "Layout", "What tpsim.layout returns: the drawing as text and as SVG")
      .def_readonly("text", &PyLayout::text)
      .def_readonly("svg", &PyLayout::svg)
      .def("__str__", [](const PyLayout& l) { return l.text; })
      .def("__repr__", [](const PyLayout& l) { return l.text; })
      .def("_repr_svg_", [](const PyLayout& l) { return l.svg; });

  m.def("run", &run,
        "run(*, layer, tp=2, inputs=None, seed=1234, verify='bound', ...) -> RunResult\n\n"
        "One layer sharded over simulated ranks, forward and backward, checked against the unsharded\n"
        "computation: `tpsim run`, with each flag as a keyword (--gtp-remat 2 is gtp_remat=2,\n"
        "--sequence-parallel is sequence_parallel=True). inputs: name -> array for every tensor of the\n"
        "layer (float32, float64 or float16 values, rounded to dtype; int64 token ids); without it the\n"
        "data is generated from seed and the size arguments. The result holds the unsharded results and\n"
        "each rank's shards, pad counts and duplicate filters' choices. Raises ValueError with the CLI's\n"
        "message for a bad argument or input, tpsim.RankFailure when a rank fails, KeyboardInterrupt on\n"
        "Ctrl-C, which stops the run at once.");
  py::module_ checkpoint = m.def_submodule(
      "checkpoint", "Sharded checkpoints as `tpsim run --save-checkpoint` writes them: `tpsim checkpoint` as functions");
  py::class_<PyCheckpoint>(checkpoint, "Checkpoint", "What inspect returns: the report and its table as data")
      .def_readonly("text", &PyCheckpoint::text, "what `tpsim checkpoint inspect` prints")
      .def_readonly("layer", &PyCheckpoint::layer, "the saving run's --layer ('' when not recorded)")
      .def_readonly("keys", &PyCheckpoint::keys,
                    "key -> dict(dtype, global_shape, saved_shape, chunks, writers, padding, placement)")
      .def_readonly("objects", &PyCheckpoint::objects, "_extra_state key -> dict(global_shape, writers)")
      .def("__str__", [](const PyCheckpoint& c) { return c.text; })
      .def("__repr__", [](const PyCheckpoint& c) { return c.text; });
  checkpoint.def("inspect", &inspectCheckpoint, py::arg("path"),
                 "inspect(path) -> Checkpoint\n\n"
                 "The checkpoint in directory `path`, read and checked whole (index, headers, checksums, tiling):\n"
                 "`tpsim checkpoint inspect`. Raises ValueError with the CLI's message for a missing, corrupt or\n"
                 "incomplete checkpoint.");
  checkpoint.def("load", &loadCheckpoint, py::arg("path"),
                 "load(path) -> dict\n\n"
                 "key -> array: every tensor of the checkpoint unsharded, pad rows dropped (the values\n"
                 "consolidate writes; float32, exact for every saved dtype). Keys are named as tpsim.run's\n"
                 "inputs, so they can be passed to it. Raises ValueError as inspect does.");
  checkpoint.def("consolidate", &consolidateCheckpointTo, py::arg("path"), py::arg("file"),
                 py::arg("dtype") = "saved",
                 "consolidate(path, file, dtype='saved') -> str\n\n"
                 "Writes every tensor unsharded into one safetensors file (all or nothing) and returns what\n"
                 "`tpsim checkpoint consolidate` prints. dtype: saved, fp32, bf16 or fp16.");

  m.def("layout", &layout,
        "layout(*, layer, tp=2, ...) -> Layout\n\n"
        "The placements of every tensor of the layer, drawn: `tpsim layout` with each flag as a keyword.\n"
        "str() is the text drawing; in Jupyter it shows as SVG.");
}
