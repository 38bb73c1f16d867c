#include "core/rank_grid.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <sstream>

#include "backends/errors.h"

namespace tpsim {
namespace {

std::vector<std::string> splitAxes(const std::string& text) {
  std::vector<std::string> parts;
  std::string::size_type begin = 0;
  while (true) {
    auto end = text.find('-', begin);
    parts.push_back(text.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (end == std::string::npos) return parts;
    begin = end + 1;
  }
}

std::string joinAxes(const std::vector<std::string>& axes) {
  std::string s;
  for (const auto& a : axes) s += (s.empty() ? "" : ", ") + a;
  return "{" + s + "}";
}

}  // namespace

RankGrid::RankGrid(const std::string& order, const std::vector<AxisSize>& sizes, int rankOffset)
    : rankOffset_(rankOffset) {
  TPSIM_CHECK(rankOffset >= 0, "RankGrid: rank_offset must be >= 0, got ", rankOffset);
  std::vector<std::string> known;
  for (const AxisSize& a : sizes) {
    TPSIM_CHECK(!a.name.empty() && a.name.find('-') == std::string::npos,
                "RankGrid: axis names must be non-empty and free of '-', got '", a.name, "'");
    TPSIM_CHECK(std::find(known.begin(), known.end(), a.name) == known.end(),
                "RankGrid: each axis takes one size, got '", a.name, "' twice");
    TPSIM_CHECK(a.size >= 1, "RankGrid: size of axis '", a.name, "' must be >= 1, got ", a.size);
    known.push_back(a.name);
  }
  auto sizeOf = [&](const std::string& name) {
    return sizes[std::find(known.begin(), known.end(), name) - known.begin()].size;
  };
  auto append = [&](const std::string& name) {
    axes_.push_back(name);
    sizes_.push_back(sizeOf(name));
  };

  for (const std::string& name : splitAxes(order)) {
    TPSIM_CHECK(std::find(known.begin(), known.end(), name) != known.end(),
                "RankGrid: every axis in the order must be one of ", joinAxes(known), ", got '", name,
                "' in order '", order, "'");
    TPSIM_CHECK(std::find(axes_.begin(), axes_.end(), name) == axes_.end(),
                "RankGrid: each axis may appear once in the order, got '", name, "' twice in '", order,
                "'");
    append(name);
  }
  // Megatron appends the axes the order leaves out; only size-1 axes may be left out, since a
  // size-1 axis does not move any rank wherever it sits.
  for (const std::string& name : known) {
    if (std::find(axes_.begin(), axes_.end(), name) != axes_.end()) continue;
    TPSIM_CHECK(sizeOf(name) == 1, "RankGrid: axis '", name, "' has size ", sizeOf(name),
                " and must appear in the order, got order '", order, "'; add '", name, "' to it");
    append(name);
  }

  std::int64_t stride = 1;
  for (int size : sizes_) {
    strides_.push_back(int(stride));
    stride *= size;
    TPSIM_CHECK(stride + rankOffset <= INT_MAX, "RankGrid: offset + product of axis sizes must fit in ",
                "an int, got ", str());
  }
  size_ = int(stride);
}

int RankGrid::axisSize(const std::string& axis) const {
  auto it = std::find(axes_.begin(), axes_.end(), axis);
  TPSIM_CHECK(it != axes_.end(), "RankGrid::axisSize: axis must be one of ", joinAxes(axes_), ", got '",
              axis, "'");
  return sizes_[it - axes_.begin()];
}

std::string RankGrid::str() const {
  std::ostringstream os;
  for (std::size_t k = 0; k < axes_.size(); ++k) os << (k ? "-" : "") << axes_[k] << "=" << sizes_[k];
  os << " (offset " << rankOffset_ << ")";
  return os.str();
}

std::vector<int> RankGrid::coordinates(int globalRank) const {
  TPSIM_CHECK(globalRank >= rankOffset_ && globalRank - rankOffset_ < size_,
              "RankGrid::coordinates: global rank must be in [", rankOffset_, ", ", rankOffset_ + size_,
              "), got ", globalRank);
  int local = globalRank - rankOffset_;
  std::vector<int> coords(axes_.size());
  for (std::size_t k = 0; k < axes_.size(); ++k) coords[k] = (local / strides_[k]) % sizes_[k];
  return coords;
}

int RankGrid::rankAt(const std::vector<int>& coordinates) const {
  TPSIM_CHECK(coordinates.size() == axes_.size(), "RankGrid::rankAt: expected ", axes_.size(),
              " coordinates (one per axis of ", str(), "), got ", coordinates.size());
  int rank = rankOffset_;
  for (std::size_t k = 0; k < axes_.size(); ++k) {
    TPSIM_CHECK(coordinates[k] >= 0 && coordinates[k] < sizes_[k], "RankGrid::rankAt: coordinate '",
                axes_[k], "' must be in [0, ", sizes_[k], "), got ", coordinates[k]);
    rank += coordinates[k] * strides_[k];
  }
  return rank;
}

std::vector<bool> RankGrid::selection(const std::string& token, const char* where) const {
  std::vector<bool> selected(axes_.size(), false);
  for (const std::string& name : splitAxes(token)) {
    auto it = std::find(axes_.begin(), axes_.end(), name);
    TPSIM_CHECK(it != axes_.end(), where, ": every axis in the token must be one of ", joinAxes(axes_),
                ", got '", name, "' in token '", token, "'");
    auto k = it - axes_.begin();
    TPSIM_CHECK(!selected[k], where, ": each axis may appear once in a token, got '", name,
                "' twice in '", token, "'");
    selected[k] = true;
  }
  return selected;
}

int RankGrid::radixIndex(const std::vector<int>& coords, const std::vector<bool>& selected, bool want) const {
  int index = 0;
  int radix = 1;
  for (std::size_t k = 0; k < axes_.size(); ++k) {
    if (selected[k] != want) continue;
    index += coords[k] * radix;
    radix *= sizes_[k];
  }
  return index;
}

std::vector<std::vector<int>> RankGrid::groups(const std::string& token) const {
  std::vector<bool> selected = selection(token, "RankGrid::groups");
  int groupSize = 1;
  for (std::size_t k = 0; k < axes_.size(); ++k)
    if (selected[k]) groupSize *= sizes_[k];
  std::vector<std::vector<int>> result(size_ / groupSize);
  for (auto& g : result) g.reserve(groupSize);
  // Walking ranks in increasing order visits each group's members in increasing selected index,
  // because the selected index grows with the rank among ranks that share the other coordinates.
  for (int local = 0; local < size_; ++local) {
    std::vector<int> coords = coordinates(rankOffset_ + local);
    result[radixIndex(coords, selected, false)].push_back(rankOffset_ + local);
  }
  return result;
}

int RankGrid::groupIndex(const std::string& token, int globalRank) const {
  return radixIndex(coordinates(globalRank), selection(token, "RankGrid::groupIndex"), false);
}

int RankGrid::groupRank(const std::string& token, int globalRank) const {
  return radixIndex(coordinates(globalRank), selection(token, "RankGrid::groupRank"), true);
}

std::vector<int> RankGrid::groupOf(const std::string& token, int globalRank) const {
  std::vector<bool> selected = selection(token, "RankGrid::groupOf");
  std::vector<int> coords = coordinates(globalRank);
  int groupSize = 1;
  for (std::size_t k = 0; k < axes_.size(); ++k)
    if (selected[k]) groupSize *= sizes_[k];
  std::vector<int> members;
  members.reserve(groupSize);
  for (int member = 0; member < groupSize; ++member) {
    int rest = member;
    for (std::size_t k = 0; k < axes_.size(); ++k) {
      if (!selected[k]) continue;
      coords[k] = rest % sizes_[k];
      rest /= sizes_[k];
    }
    members.push_back(rankAt(coords));
  }
  return members;
}

namespace {

int gtpFromShards(std::optional<int> shards, int tp, const char* where, const char* shardsName,
                  const char* tpName) {
  TPSIM_CHECK(tp >= 1, where, ": ", tpName, " must be >= 1, got ", tp);
  if (!shards) return 1;
  TPSIM_CHECK(*shards >= tp, where, ": ", shardsName, " must be >= ", tpName, " (", tp, "), got ", *shards,
              "; use T·G shards for G GTP_remat peers");
  TPSIM_CHECK(*shards % tp == 0, where, ": ", shardsName, " must be a multiple of ", tpName, " (", tp,
              "), got ", *shards, "; use T·G shards for G GTP_remat peers");
  return *shards / tp;
}

// SPEC 1.4.2 inserts gtp_remat right after `anchor` (Megatron's _inject_gtp_remat_axis): an order
// that already names gtp_remat is kept, and without the anchor it goes after tp, else first.
std::string insertGtpRemat(const std::string& order, const std::string& anchor) {
  std::vector<std::string> axes = splitAxes(order);
  if (std::find(axes.begin(), axes.end(), "gtp_remat") != axes.end()) return order;
  auto at = std::find(axes.begin(), axes.end(), anchor);
  if (at == axes.end()) at = std::find(axes.begin(), axes.end(), "tp");
  axes.insert(at == axes.end() ? axes.begin() : at + 1, "gtp_remat");
  std::string joined;
  for (const auto& a : axes) joined += (joined.empty() ? "" : "-") + a;
  return joined;
}

ParallelSizes checkedSizes(ParallelSizes s) {
  auto positive = [](int value, const char* name) {
    TPSIM_CHECK(value >= 1, "ParallelLayout: ", name, " must be >= 1, got ", value);
  };
  positive(s.world, "world size");
  positive(s.tp, "tp (T)");
  positive(s.pp, "pp (P)");
  positive(s.cp, "cp (C)");
  positive(s.ep, "ep (E)");
  positive(s.gtpRemat, "gtp_remat (G)");
  positive(s.expertGtpRemat, "expert gtp_remat (EG)");
  positive(s.distOptInstances, "num_distributed_optimizer_instances");
  TPSIM_CHECK(s.expertTp >= 0, "ParallelLayout: expert tp (ET) must be >= 1, or 0 for the same as tp, got ",
              s.expertTp);
  if (s.expertTp == 0) s.expertTp = s.tp;
  return s;
}

// "T·P·C·G = 2·1·1·3 = 6" and whether that product divides the world size. The product is
// capped just above the world so huge factors cannot overflow; a capped product never divides.
struct Divisor {
  std::string text;
  int value = 0;  // 0 when the product exceeds the world size
};

Divisor divisor(const char* names, std::initializer_list<int> factors, int world) {
  std::ostringstream os;
  os << names << " = ";
  std::int64_t p = 1;
  const char* sep = "";
  for (int f : factors) {
    os << sep << f;
    sep = "·";
    p = std::min<std::int64_t>(p * f, std::int64_t(world) + 1);
  }
  if (p > world)
    os << " > " << world;
  else
    os << " = " << p;
  return {os.str(), p > world ? 0 : int(p)};
}

int denseDp(const ParallelSizes& s) {
  Divisor d = divisor("T·P·C·G", {s.tp, s.pp, s.cp, s.gtpRemat}, s.world);
  TPSIM_CHECK(d.value != 0 && s.world % d.value == 0,
              "ParallelLayout: dense data-parallel size D = W/(T·P·C·G) must be an integer, got W = ",
              s.world, " and ", d.text, "; pick sizes whose product divides the world size");
  return s.world / d.value;
}

int expertDpSize(const ParallelSizes& s) {
  Divisor d = divisor("ET·E·P·EG", {s.expertTp, s.ep, s.pp, s.expertGtpRemat}, s.world);
  TPSIM_CHECK(d.value != 0 && s.world % d.value == 0,
              "ParallelLayout: expert data-parallel size ED = W/(ET·E·P·EG) must be an integer, got W = ",
              s.world, " and ", d.text, "; pick sizes whose product divides the world size");
  return s.world / d.value;
}

}  // namespace

int gtpRematSize(std::optional<int> numWeightShards, int tp) {
  return gtpFromShards(numWeightShards, tp, "gtpRematSize", "tensor_parallel_num_weight_shards",
                       "tensor_model_parallel_size");
}

int expertGtpRematSize(std::optional<int> numWeightShards, int expertTp) {
  return gtpFromShards(numWeightShards, expertTp, "expertGtpRematSize",
                       "expert_tensor_parallel_num_weight_shards", "expert_tensor_parallel_size");
}

const std::array<GroupSpec, kNumGroupIds>& groupSpecs() {
  static const std::array<GroupSpec, kNumGroupIds> kSpecs = {{
      {GroupId::kTp, GridKind::kDense, "tp", "tp"},
      {GroupId::kGtpRemat, GridKind::kDense, "gtp_remat", "gtp_remat"},
      {GroupId::kDp, GridKind::kDense, "dp", "dp"},
      {GroupId::kDpCp, GridKind::kDense, "dp-cp", "dp_cp"},
      {GroupId::kDpGtp, GridKind::kDense, "gtp_remat-dp", "dp_gtp"},
      {GroupId::kDpCpGtp, GridKind::kDense, "gtp_remat-dp-cp", "dp_cp_gtp"},
      {GroupId::kModelParallel, GridKind::kDense, "tp-gtp_remat-pp", "mp"},
      {GroupId::kTpDp, GridKind::kDense, "tp-gtp_remat-dp-cp", "tp_dp"},
      {GroupId::kExpertTp, GridKind::kExpert, "tp", "etp"},
      {GroupId::kEp, GridKind::kExpert, "ep", "ep"},
      {GroupId::kExpertGtpRemat, GridKind::kExpert, "gtp_remat", "egtp"},
      {GroupId::kExpertDp, GridKind::kExpert, "dp", "edp"},
      {GroupId::kExpertDpGtp, GridKind::kExpert, "gtp_remat-dp", "edp_egtp"},
      {GroupId::kIntraDistOpt, GridKind::kExpert, "tp-ep-gtp_remat-pp", "intra_dist_opt"},
  }};
  return kSpecs;
}

const GroupSpec& groupSpec(GroupId id) {
  int index = int(id);
  TPSIM_CHECK(index >= 0 && index < kNumGroupIds, "groupSpec: id must be in [0, ", kNumGroupIds, "), got ",
              index);
  return groupSpecs()[index];
}

ParallelLayout::ParallelLayout(const ParallelSizes& sizes)
    : sizes_(checkedSizes(sizes)),
      dp_(denseDp(sizes_)),
      expertDp_(expertDpSize(sizes_)),
      dense_(insertGtpRemat(sizes_.order, "tp"),
             {{"tp", sizes_.tp}, {"gtp_remat", sizes_.gtpRemat}, {"cp", sizes_.cp}, {"ep", 1}, {"dp", dp_},
              {"pp", sizes_.pp}}),
      expert_(insertGtpRemat(sizes_.order, "ep"),
              {{"tp", sizes_.expertTp}, {"cp", 1}, {"ep", sizes_.ep}, {"gtp_remat", sizes_.expertGtpRemat},
               {"dp", expertDp_}, {"pp", sizes_.pp}}) {
  // One pipeline schedule drives both kinds of layer, so a stage must hold the same ranks in both
  // grids (Megatron asserts the same). It can only fail when pp is not the slowest axis.
  TPSIM_CHECK(dense_.groups("pp") == expert_.groups("pp"), "ParallelLayout: the dense grid ", dense_.str(),
              " and the expert grid ", expert_.str(),
              " must give the same pp groups, got different ones for order '", sizes_.order,
              "'; put pp last in the order or make D equal ED");
  const int instances = sizes_.distOptInstances;
  // GTP_remat shards every weight over peers that the gradient statistics must all see; with
  // several instances each would see only its own peers (SPEC 4.12).
  TPSIM_CHECK(instances == 1 || (sizes_.gtpRemat == 1 && sizes_.expertGtpRemat == 1),
              "ParallelLayout: num_distributed_optimizer_instances must be 1 with GTP_remat (G = ",
              sizes_.gtpRemat, ", EG = ", sizes_.expertGtpRemat, "), got ", instances);
  TPSIM_CHECK((dp_ * sizes_.cp) % instances == 0, "ParallelLayout: num_distributed_optimizer_instances (",
              instances, ") must divide the data-parallel size with context parallelism D·C = ", dp_, "·",
              sizes_.cp, " = ", dp_ * sizes_.cp);
  TPSIM_CHECK(expertDp_ % instances == 0, "ParallelLayout: num_distributed_optimizer_instances (", instances,
              ") must divide the expert data-parallel size ED = ", expertDp_);
}

// An instance group concatenates `span` consecutive expert model-parallel groups, as Megatron
// builds it. Its token includes gtp_remat: Megatron's "tp-ep-pp" groups would leave out the EGTP
// peers, and an instance would then cover only 1/EG of the world (SPEC 5.4 G17).
std::vector<std::vector<int>> ParallelLayout::groups(GroupId id) const {
  const GroupSpec& spec = groupSpec(id);
  std::vector<std::vector<int>> parts = grid(spec.grid).groups(spec.token);
  if (id != GroupId::kIntraDistOpt) return parts;
  std::vector<std::vector<int>> runs(parts.size() / intraDistOptSpan());
  for (std::size_t i = 0; i < parts.size(); ++i) {
    auto& run = runs[i / intraDistOptSpan()];
    run.insert(run.end(), parts[i].begin(), parts[i].end());
  }
  return runs;
}

int ParallelLayout::groupIndex(GroupId id, int globalRank) const {
  const GroupSpec& spec = groupSpec(id);
  const int index = grid(spec.grid).groupIndex(spec.token, globalRank);
  return id == GroupId::kIntraDistOpt ? index / intraDistOptSpan() : index;
}

int ParallelLayout::groupRank(GroupId id, int globalRank) const {
  const GroupSpec& spec = groupSpec(id);
  const RankGrid& g = grid(spec.grid);
  const int rank = g.groupRank(spec.token, globalRank);
  if (id != GroupId::kIntraDistOpt) return rank;
  const int partSize = g.size() / expertDp_;  // one group per expert data-parallel index
  return g.groupIndex(spec.token, globalRank) % intraDistOptSpan() * partSize + rank;
}

std::vector<int> ParallelLayout::groupOf(GroupId id, int globalRank) const {
  if (id == GroupId::kIntraDistOpt) return groups(id)[groupIndex(id, globalRank)];
  const GroupSpec& spec = groupSpec(id);
  return grid(spec.grid).groupOf(spec.token, globalRank);
}

namespace {

ParallelSizes layerSizes(int tp, int gtpRemat) {
  TPSIM_CHECK(tp >= 1 && gtpRemat >= 1 && tp <= std::numeric_limits<int>::max() / gtpRemat,
              "LayerGrid: expected T >= 1 and G >= 1 with T x G in int, got T = ", tp, ", G = ", gtpRemat);
  ParallelSizes sizes;
  sizes.world = tp * gtpRemat;
  sizes.tp = tp;
  sizes.gtpRemat = gtpRemat;
  sizes.expertGtpRemat = gtpRemat;  // experts shard their weights over the same peers (EGTP_remat)
  return sizes;
}

}  // namespace

LayerGrid::LayerGrid(int tp, int gtpRemat) : layout_(layerSizes(tp, gtpRemat)) {}

int LayerGrid::rank(int t, int g) const {
  const RankGrid& grid = layout_.dense();
  std::vector<int> coordinates(grid.axes().size(), 0);
  for (std::size_t k = 0; k < grid.axes().size(); ++k) {
    if (grid.axes()[k] == "tp") coordinates[k] = t;
    if (grid.axes()[k] == "gtp_remat") coordinates[k] = g;
  }
  return grid.rankAt(coordinates);
}

int LayerGrid::t(int rank) const { return layout_.groupRank(GroupId::kTp, rank); }

int LayerGrid::g(int rank) const { return layout_.groupRank(GroupId::kGtpRemat, rank); }

}  // namespace tpsim
