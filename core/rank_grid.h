// RankGrid and ParallelLayout: Megatron's orthogonal process-group grid (RankGenerator, SPEC 1.4).
//
// A RankGrid numbers ranks by mixed radix over named axes, fastest first: rank = offset + Σ i_k·stride_k.
// A group "token" such as "gtp_remat-dp" selects axes; its groups are the ranks that agree on all
// other coordinates. ParallelLayout derives D and ED from the parallel sizes and builds the dense
// and the expert grid, plus the table of named groups. Pure integer math: nothing here
// communicates (core/process_groups.h turns groups into communicators).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace tpsim {

struct AxisSize {
  std::string name;
  int size = 1;
};

class RankGrid {
 public:
  // order: axis names joined by '-', fastest varying first ("tp-gtp_remat-cp-ep-dp-pp").
  // sizes: every axis this grid knows, once each. Axes missing from order are appended in the
  // order of `sizes` and must have size 1.
  RankGrid(const std::string& order, const std::vector<AxisSize>& sizes, int rankOffset = 0);

  const std::vector<std::string>& axes() const { return axes_; }  // grid order, after appending
  const std::vector<int>& sizes() const { return sizes_; }        // parallel to axes()
  int axisSize(const std::string& axis) const;
  int size() const { return size_; }  // number of ranks, Π sizes
  int rankOffset() const { return rankOffset_; }
  std::string str() const;  // "tp=2-gtp_remat=2-cp=1-ep=1-dp=2-pp=1 (offset 0)"

  // Rank <-> coordinates (parallel to axes()); a bijection onto [offset, offset + size()).
  std::vector<int> coordinates(int globalRank) const;
  int rankAt(const std::vector<int>& coordinates) const;

  // token: '-'-separated axes, in any order ("dp-gtp_remat" == "gtp_remat-dp").
  // All groups, ordered by the mixed-radix index of the unselected coordinates; each group's
  // members ordered by the mixed-radix index of the selected ones (leftmost grid axis fastest).
  std::vector<std::vector<int>> groups(const std::string& token) const;
  int groupIndex(const std::string& token, int globalRank) const;  // which of groups(token)
  int groupRank(const std::string& token, int globalRank) const;   // position within that group
  std::vector<int> groupOf(const std::string& token, int globalRank) const;

 private:
  std::vector<bool> selection(const std::string& token, const char* where) const;
  // Mixed-radix index of coords over the axes where selected[k] == want, leftmost fastest.
  int radixIndex(const std::vector<int>& coords, const std::vector<bool>& selected, bool want) const;

  std::vector<std::string> axes_;
  std::vector<int> sizes_;
  std::vector<int> strides_;
  int rankOffset_ = 0;
  int size_ = 1;
};

// G from tensor_parallel_num_weight_shards (SPEC 1.4.1): shards / T, or 1 when unset. Throws when
// shards < T or shards is not a multiple of T. The expert form reads
// expert_tensor_parallel_num_weight_shards over ET.
int gtpRematSize(std::optional<int> numWeightShards, int tp);
int expertGtpRematSize(std::optional<int> numWeightShards, int expertTp);

struct ParallelSizes {
  int world = 1;
  int tp = 1;              // T
  int pp = 1;              // P
  int cp = 1;              // C
  int ep = 1;              // E
  int gtpRemat = 1;        // G
  int expertTp = 0;        // ET; 0 = same as tp
  int expertGtpRemat = 1;  // EG
  // num_distributed_optimizer_instances: the distributed optimizer is replicated this many times
  // over the data-parallel axis. Must divide D·C and ED; must be 1 when G > 1 or EG > 1.
  int distOptInstances = 1;
  // User order without gtp_remat; ParallelLayout inserts it per grid.
  std::string order = "tp-cp-ep-dp-pp";
};

enum class GridKind { kDense, kExpert };

// The named groups of SPEC 1.4.2, in the order ProcessGroups creates them.
enum class GroupId {
  kTp,              // dense "tp"
  kGtpRemat,        // dense "gtp_remat"
  kDp,              // dense "dp" (replicate DP)
  kDpCp,            // dense "dp-cp", the gtp-excluded dp_cp
  kDpGtp,           // dense "gtp_remat-dp", the gtp-inclusive DP
  kDpCpGtp,         // dense "gtp_remat-dp-cp", the gtp-inclusive dp_cp
  kModelParallel,   // dense "tp-gtp_remat-pp"
  kTpDp,            // dense "tp-gtp_remat-dp-cp": TP×DP with CP, spanning GTP
  kExpertTp,        // expert "tp"
  kEp,              // expert "ep"
  kExpertGtpRemat,  // expert "gtp_remat" (EGTP_remat)
  kExpertDp,        // expert "dp" (replicate expert DP)
  kExpertDpGtp,     // expert "gtp_remat-dp"
  kIntraDistOpt,    // one distributed-optimizer instance: ED/instances consecutive expert
                    // "tp-ep-gtp_remat-pp" groups; the whole world with one instance
};
inline constexpr int kNumGroupIds = 14;

struct GroupSpec {
  GroupId id;
  GridKind grid;
  const char* token;
  const char* label;  // communicator label: "tp", "dp_gtp", "edp_egtp", ...
};

// Indexed by int(GroupId).
const std::array<GroupSpec, kNumGroupIds>& groupSpecs();
const GroupSpec& groupSpec(GroupId id);

class ParallelLayout {
 public:
  // Throws InvalidArgument when a size is < 1, when D = W/(T·P·C·G) or ED = W/(ET·E·P·EG) is not
  // an integer, when an axis of size > 1 is missing from the order, when the two grids would
  // disagree on the pipeline groups, or when the distributed-optimizer instances do not divide D·C
  // and ED or are combined with GTP_remat.
  explicit ParallelLayout(const ParallelSizes& sizes);

  const ParallelSizes& sizes() const { return sizes_; }  // expertTp resolved (never 0)
  int world() const { return sizes_.world; }
  int dp() const { return dp_; }              // D
  int expertDp() const { return expertDp_; }  // ED
  int distOptInstances() const { return sizes_.distOptInstances; }

  const RankGrid& dense() const { return dense_; }    // tp-gtp_remat-cp-ep-dp-pp: (T, G, C, 1, D, P)
  const RankGrid& expert() const { return expert_; }  // tp-cp-ep-gtp_remat-dp-pp: (ET, 1, E, EG, ED, P)
  const RankGrid& grid(GridKind kind) const { return kind == GridKind::kDense ? dense_ : expert_; }

  std::vector<std::vector<int>> groups(GroupId id) const;
  int groupIndex(GroupId id, int globalRank) const;
  int groupRank(GroupId id, int globalRank) const;
  std::vector<int> groupOf(GroupId id, int globalRank) const;

 private:
  // kIntraDistOpt is not one token's groups but runs of them; every other id is spec.token's.
  int intraDistOptSpan() const { return expertDp_ / sizes_.distOptInstances; }

  ParallelSizes sizes_;
  int dp_;
  int expertDp_;
  RankGrid dense_;
  RankGrid expert_;
};

// The T x G world of one layer under GTP_remat, as the tools run it: ParallelLayout's grids with
// TP and GTP_remat only (the expert grid's ET = T and EG = G: the same peers). The one place the tools map a TP rank t and a GTP_remat rank g to a
// world rank and back.
class LayerGrid {
 public:
  LayerGrid(int tp, int gtpRemat);

  int tp() const { return layout_.sizes().tp; }
  int gtpRemat() const { return layout_.sizes().gtpRemat; }
  int size() const { return layout_.world(); }
  const ParallelLayout& layout() const { return layout_; }

  int rank(int t, int g) const;
  int t(int rank) const;  // TP rank
  int g(int rank) const;  // GTP_remat rank

 private:
  ParallelLayout layout_;
};

}  // namespace tpsim
