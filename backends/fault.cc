#include "backends/fault.h"

#include <vector>

#include "backends/errors.h"

namespace tpsim {

namespace {
constexpr FaultKind kAllKinds[] = {FaultKind::kSkip,  FaultKind::kOp,    FaultKind::kCount, FaultKind::kDtype,
                                   FaultKind::kGroup, FaultKind::kThrow, FaultKind::kStall, FaultKind::kCorrupt};

// Digits only, so "-1", "+1", "1e3" and "0x10" are refused rather than read loosely.
bool parseNonNegative(const std::string& s, std::int64_t& out) {
  if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos) return false;
  out = std::stoll(s);
  return true;
}
}  // namespace

const char* faultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kSkip: return "skip";
    case FaultKind::kOp: return "op";
    case FaultKind::kCount: return "count";
    case FaultKind::kDtype: return "dtype";
    case FaultKind::kGroup: return "group";
    case FaultKind::kThrow: return "throw";
    case FaultKind::kStall: return "stall";
    case FaultKind::kCorrupt: return "corrupt";
  }
  return "unknown";
}

std::string Fault::str() const {
  const std::string s = detail::concat(rank, ":", collective, ":", faultKindName(kind));
  return kind == FaultKind::kCorrupt && (element != 0 || bit != -1) ? detail::concat(s, ":", element, ":", bit) : s;
}

int topExponentBit(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64: return 62;
    case DType::kFloat32: return 30;
    case DType::kBFloat16:
    case DType::kFloat16: return 14;
    default: return 6;  // the fp8 formats: a sign, then the exponent from bit 6 down
  }
}

Fault parseFault(const std::string& spec) {
  std::vector<std::string> parts(1);
  for (char ch : spec) {
    if (ch == ':')
      parts.emplace_back();
    else
      parts.back().push_back(ch);
  }
  const bool corruptAt = parts.size() == 5 && parts[2] == "corrupt";
  TPSIM_CHECK(parts.size() == 3 || corruptAt, "expected RANK:K:FAULT (three fields separated by ':'), got '", spec,
              "'; corrupt may add :ELEMENT:BIT");
  Fault f;
  std::int64_t rank = 0;
  TPSIM_CHECK(parseNonNegative(parts[0], rank) && rank <= 1'000'000, "expected RANK to be a rank number >= 0, got '",
              parts[0], "' in '", spec, "'");
  f.rank = int(rank);
  TPSIM_CHECK(parseNonNegative(parts[1], f.collective) && f.collective >= 1,
              "expected K >= 1 (the rank's K-th collective, counted from 1), got '", parts[1], "' in '", spec, "'");
  if (corruptAt) {
    std::int64_t bit = 0;
    TPSIM_CHECK(parseNonNegative(parts[3], f.element), "expected ELEMENT to be a flat index >= 0, got '", parts[3],
                "' in '", spec, "'");
    TPSIM_CHECK(parseNonNegative(parts[4], bit) && bit <= 63, "expected BIT in 0..63, got '", parts[4], "' in '",
                spec, "'");
    f.bit = int(bit);
  }
  for (FaultKind k : kAllKinds)
    if (parts[2] == faultKindName(k)) {
      f.kind = k;
      return f;
    }
  throw InvalidArgument(detail::concat("expected FAULT to be skip, op, count, dtype, group, throw, stall or corrupt, "
                                       "got '", parts[2], "' in '", spec, "'"));
}

}  // namespace tpsim
