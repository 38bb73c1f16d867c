#include "tools/lib/layout.h"

#include <algorithm>
#include <map>
#include <set>

#include "backends/errors.h"
#include "core/rank_grid.h"
#include "tools/lib/runner.h"

namespace tpsim::tools {
namespace {

constexpr int kMaxTextCols = 64, kMaxTextRows = 32;

// A block drawn in two dims: rows are dim 0, columns the later dims flattened (a 1-D tensor is one
// column), all in layout coordinates.
struct Rect {
  std::int64_t r0, r1, c0, c1;
  int t, g;
  bool pad;
};

std::int64_t rowsOf(const TensorPlacement& p) { return p.layoutShape()[0]; }
std::int64_t colsOf(const TensorPlacement& p) {
  std::int64_t n = 1;
  for (std::size_t d = 1; d < p.shape.size(); ++d) n *= p.layoutShape()[d];
  return n;
}

std::vector<Rect> rectsOf(const TensorPlacement& p) {
  std::vector<Rect> out;
  const auto shape = p.layoutShape();
  for (int g = 0; g < p.gtp.size; ++g)
    for (int t = 0; t < p.tp.size; ++t)
      for (const Block& b : blocksOf(p, t, g)) {
        const Range rows = b.layout[0];
        if (shape.size() == 1) {
          out.push_back({rows.begin, rows.end, 0, 1, t, g, b.pad});
        } else if (shape.size() == 2) {
          out.push_back({rows.begin, rows.end, b.layout[1].begin, b.layout[1].end, t, g, b.pad});
        } else {
          TPSIM_INTERNAL_ASSERT(shape.size() == 3, "layout draws tensors of rank <= 3, got ", p.name);
          const std::int64_t inner = shape[2];
          if (b.layout[2].begin == 0 && b.layout[2].end == inner) {
            out.push_back({rows.begin, rows.end, b.layout[1].begin * inner, b.layout[1].end * inner, t, g, b.pad});
          } else {
            for (std::int64_t i = b.layout[1].begin; i < b.layout[1].end; ++i)
              out.push_back({rows.begin, rows.end, i * inner + b.layout[2].begin, i * inner + b.layout[2].end, t, g,
                             b.pad});
          }
        }
      }
  return out;
}

// The layout index drawn at row r, column c (columns flatten the dims after the first).
std::vector<std::int64_t> indexAt(const TensorPlacement& p, std::int64_t r, std::int64_t c) {
  const auto shape = p.layoutShape();
  if (shape.size() == 1) return {r};
  if (shape.size() == 2) return {r, c};
  return {r, c / shape[2], c % shape[2]};
}

int copiesOf(const TensorPlacement& p) {
  return (p.tp.kind == AxisKind::kShard ? 1 : p.tp.size) * (p.gtp.kind == AxisKind::kShard ? 1 : p.gtp.size);
}

// Positions on a scale of at most `cap` units for the sorted boundaries 0 = b_0 < ... < b_k: one
// unit per element when the extent fits, else each segment gets minUnits plus its share of the
// rest, so every block stays visible; with more segments than that allows, plain proportion.
std::vector<int> scaled(const std::vector<std::int64_t>& bounds, int cap, int minUnits) {
  const std::int64_t extent = bounds.back();
  const std::int64_t k = std::int64_t(bounds.size()) - 1;
  std::vector<int> pos;
  if (extent <= cap && minUnits <= 1) {
    for (auto b : bounds) pos.push_back(int(b));
  } else if (k * minUnits <= cap) {
    const std::int64_t spare = cap - k * minUnits;
    pos.push_back(0);
    for (std::int64_t i = 1; i <= k; ++i)
      pos.push_back(pos.back() + minUnits + int(spare * (bounds[i] - bounds[i - 1]) / extent));
  } else {
    for (auto b : bounds) pos.push_back(int(b * cap / extent));
  }
  return pos;
}

std::vector<std::int64_t> boundaries(const std::vector<Rect>& rects, std::int64_t extent, bool rows) {
  std::set<std::int64_t> s{0, extent};
  for (const Rect& r : rects) {
    s.insert(rows ? r.r0 : r.c0);
    s.insert(rows ? r.r1 : r.c1);
  }
  return {s.begin(), s.end()};
}

std::string rankLabel(const LayerGrid& grid, int t, int g) {
  return detail::concat("r", grid.rank(t, g), " (t=", t, ", g=", g, ")");
}

std::string roleName(TensorRole r) {
  switch (r) {
    case TensorRole::kParameter: return "parameter";
    case TensorRole::kInput: return "input";
    case TensorRole::kOutput: return "output";
    case TensorRole::kGradient: return "gradient";
  }
  return "";
}

bool isParameterOrItsGradient(const TensorPlacement& p, const std::set<std::string>& params) {
  return p.role == TensorRole::kParameter ||
         (p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".grad") == 0 &&
          params.count(p.name.substr(0, p.name.size() - 5)));
}

std::set<std::string> parameterNames(const std::vector<TensorPlacement>& ps) {
  std::set<std::string> out;
  for (const auto& p : ps)
    if (p.role == TensorRole::kParameter) out.insert(p.name);
  return out;
}

// The per-rank lines under a drawing.
std::vector<std::string> rankLines(const TensorPlacement& p, bool paramLike) {
  const LayerGrid grid(p.tp.size, p.gtp.size);
  std::vector<std::string> out;
  for (int g = 0; g < p.gtp.size; ++g)
    for (int t = 0; t < p.tp.size; ++t) {
      std::string s = detail::concat(rankLabel(grid, t, g), " ", shapeText(localShape(p, t, g)), ": ",
                                     holdsText(p, t, g));
      if (paramLike)
        s += detail::concat("; gtp_local_pad_zero_count ", padZeroCount(p, t, g), "; duplicate filters: ",
                            p.countedOn(t, g) ? "counted" : "skipped");
      out.push_back(s);
    }
  return out;
}

const int kPalette[] = {75, 209, 114, 221, 177, 80, 203, 150, 111, 215, 156, 183, 44, 173, 105, 168};
const char* kSvgPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#edc948", "#b07aa1", "#76b7b2", "#e15759", "#9c755f",
                             "#86bcb6", "#ff9da7", "#8cd17d", "#d4a6c8", "#499894", "#f1ce63", "#79706e", "#d37295"};

// A rank in one character: 0-9, then a-z (layouts of more than 36 ranks draw two digits instead).
char rankChar(int r) { return r < 10 ? char('0' + r) : char('a' + r - 10); }

std::string drawText(const TensorPlacement& p, bool colour, const std::set<std::string>& params) {
  const std::int64_t R = rowsOf(p), C = colsOf(p);
  const std::vector<Rect> rects = rectsOf(p);
  const auto rb = boundaries(rects, R, true), cb = boundaries(rects, C, false);
  const auto rp = scaled(rb, kMaxTextRows, 1), cp = scaled(cb, kMaxTextCols, 1);
  const LayerGrid grid(p.tp.size, p.gtp.size);
  std::string out = detail::concat(p.name, " ", shapeText(p.shape), " ", roleName(p.role), ": ", placementText(p), "\n");
  if (p.layoutShape() != p.shape)
    out += detail::concat("  drawn with its pad rows: ", shapeText(p.layoutShape()),
                          "; row labels count drawn rows, the rank lines global rows\n");
  if (p.shape.size() == 3) out += "  columns: dims 1 and 2 flattened (dim 1 major)\n";
  const int margin = int(std::to_string(R).size()) + 1;
  // The ranks holding each drawn cell, and the distinct sets of more than one rank.
  std::vector<std::vector<std::vector<int>>> cells(std::size_t(rp.back()), std::vector<std::vector<int>>(std::size_t(cp.back())));
  std::vector<std::vector<char>> padded(std::size_t(rp.back()), std::vector<char>(std::size_t(cp.back()), 0));
  std::map<std::vector<int>, int> sets;  // holders of more than one rank -> their index, in order met
  for (int row = 0, seg = 0; row < rp.back(); ++row) {
    while (seg + 1 < int(rp.size()) && rp[std::size_t(seg) + 1] <= row) ++seg;
    for (int col = 0, cseg = 0; col < cp.back(); ++col) {
      while (cseg + 1 < int(cp.size()) && cp[std::size_t(cseg) + 1] <= col) ++cseg;
      std::vector<int>& holders = cells[std::size_t(row)][std::size_t(col)];
      for (const Holder& x : holdersOf(p, indexAt(p, rb[std::size_t(seg)], cb[std::size_t(cseg)]))) {
        holders.push_back(grid.rank(x.t, x.g));
        padded[std::size_t(row)][std::size_t(col)] |= x.pad;
      }
      if (holders.size() > 1) sets.emplace(holders, int(sets.size()));
    }
  }
  // One character a cell while every rank and every set has its own (ranks 0-9 and a-z, sets A-Z);
  // beyond that two: a rank's number, a set's pair of capitals.
  const bool wide = grid.size() > 36 || sets.size() > 26;
  const int width = wide ? 2 : 1;
  auto setCode = [&](int k) {
    return wide ? std::string{char('A' + k / 26), char('A' + k % 26)} : std::string(1, char('A' + k));
  };
  // Column boundary labels where they do not overlap the previous one.
  std::string labels(std::size_t(margin + 1 + width * cp.back() + 8), ' ');
  int free = 0;
  for (std::size_t i = 0; i < cb.size(); ++i) {
    const std::string text = std::to_string(cb[i]);
    const int at = margin + 1 + width * cp[i];
    if (at < free) continue;
    labels.replace(std::size_t(at), text.size(), text);
    free = at + int(text.size()) + 1;
  }
  while (!labels.empty() && labels.back() == ' ') labels.pop_back();
  out += labels + "\n";
  std::vector<std::string> legend;
  std::set<int> described;
  std::size_t seg = 0;
  for (int row = 0; row < rp.back(); ++row) {
    while (seg + 1 < rp.size() && rp[seg + 1] <= row) ++seg;
    const bool boundary = rp[seg] == row;
    std::string line = boundary ? std::to_string(rb[seg]) : "";
    line = std::string(std::size_t(margin) - line.size(), ' ') + line + (boundary ? "-" : "|");
    int lastBg = -1;
    for (int col = 0; col < cp.back(); ++col) {
      const std::vector<int>& holders = cells[std::size_t(row)][std::size_t(col)];
      std::string code(std::size_t(width), '?');
      int bg = 250;
      if (holders.size() == 1) {
        const bool hatch = padded[std::size_t(row)][std::size_t(col)] && (row + col) % 2;  // pad rows hatched
        code = hatch ? std::string(std::size_t(width), '/') : wide ? detail::concat(holders[0] / 10, holders[0] % 10)
                                                                   : std::string(1, rankChar(holders[0]));
        bg = kPalette[holders[0] % 16];
      } else if (!holders.empty()) {
        const int k = sets.at(holders);
        if (described.insert(k).second) {
          std::string who;
          for (int h : holders) who += detail::concat(who.empty() ? "" : " ", "r", h);
          legend.push_back(detail::concat("  ", setCode(k), " = the same elements on ", who,
                                          p.tp.kind == AxisKind::kPartial ? " (each a partial sum)" : ""));
        }
        code = setCode(k);
        bg = k % 2 ? 252 : 246;
      }
      if (colour && bg != lastBg) line += detail::concat("\033[30;48;5;", bg, "m");  // one escape per run
      lastBg = bg;
      line += code;
    }
    out += line + (colour ? "\033[0m\n" : "\n");
  }
  out += std::string(std::size_t(margin) - std::to_string(R).size(), ' ') + std::to_string(R) + "\n";
  out += wide ? "  two digits: the rank r = t + T*g holding the cells; '//' hatches GTP_remat pad rows\n"
              : "  digits and letters a-z: the rank r = t + T*g holding the cells; '/' hatches GTP_remat pad rows\n";
  for (const auto& l : legend) out += l + "\n";
  for (const auto& l : rankLines(p, isParameterOrItsGradient(p, params))) out += "  " + l + "\n";
  return out;
}

std::string xmlEscape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

}  // namespace

std::vector<TensorPlacement> layoutPlacements(const RunConfig& c) {
  c.validate();
  tensorShapes(c);  // sizes whose product overflows are refused here, naming the flags
  checkSizes(c, {SizeSources::Inputs::kFlags, ""});
  return placementsOf(c);
}

std::string layoutText(const RunConfig& c, const std::vector<TensorPlacement>& ps, bool colour) {
  std::string out = detail::concat("# tpsim layout: ", layoutLine(c), "\n");
  out += detail::concat("# ", LayerGrid(c.tp, c.gtpRemat).size(), " ranks; rank r = t + T*g holds TP rank t, GTP_remat rank g\n");
  const std::set<std::string> params = parameterNames(ps);
  for (const auto& p : ps) out += "\n" + drawText(p, colour, params);
  return out;
}

std::string layoutSvg(const RunConfig& c, const std::vector<TensorPlacement>& ps) {
  constexpr int kWidth = 1180, kLeft = 60, kBoxW = 520, kBoxH = 280, kLine = 15;
  const std::set<std::string> params = parameterNames(ps);
  const LayerGrid grid(c.tp, c.gtpRemat);
  std::string body;
  int y = 20;
  body += detail::concat("<text x=\"10\" y=\"", y, "\" class=\"title\">tpsim layout: ", xmlEscape(layoutLine(c)),
                         "</text>\n");
  y += 22;
  // Legend: a swatch per rank, the hatching, the stripes of copies.
  for (int r = 0; r < grid.size(); ++r) {
    const int x = 10 + (r % 8) * 120, row = y + (r / 8) * 20;
    body += detail::concat("<rect x=\"", x, "\" y=\"", row - 11, "\" width=\"14\" height=\"14\" fill=\"",
                           kSvgPalette[r % 16], "\"/><text x=\"", x + 18, "\" y=\"", row, "\">",
                           xmlEscape(rankLabel(grid, grid.t(r), grid.g(r))), "</text>\n");
  }
  y += ((grid.size() + 7) / 8) * 20;
  body += detail::concat("<rect x=\"10\" y=\"", y - 11, "\" width=\"14\" height=\"14\" fill=\"#bbbbbb\"/>",
                         "<rect x=\"10\" y=\"", y - 11, "\" width=\"14\" height=\"14\" fill=\"url(#hatch)\"/>",
                         "<text x=\"28\" y=\"", y, "\">GTP_remat pad rows (zeros)</text>",
                         "<text x=\"250\" y=\"", y, "\">replicated or partial: one stripe per rank holding a copy; "
                         "dashed frame: partial sums</text>\n");
  y += 24;
  for (const TensorPlacement& p : ps) {
    const std::int64_t R = rowsOf(p), C = colsOf(p);
    const std::vector<Rect> rects = rectsOf(p);
    // Drawn to scale in the panel's longer direction, at least 24 px across the other.
    int w = kBoxW, h = kBoxH;
    if (double(C) / double(kBoxW) >= double(R) / double(kBoxH)) h = std::max(24, int(double(kBoxW) * double(R) / double(C)));
    else w = std::max(24, int(double(kBoxH) * double(C) / double(R)));
    const auto rb = boundaries(rects, R, true), cb = boundaries(rects, C, false);
    const auto rp = scaled(rb, h, 3), cp = scaled(cb, w, 3);
    h = rp.back();
    w = cp.back();
    body += detail::concat("<g class=\"panel\" data-tensor=\"", xmlEscape(p.name), "\" data-rows=\"", R,
                           "\" data-cols=\"", C, "\" data-copies=\"", copiesOf(p), "\">\n");
    body += detail::concat("<text x=\"10\" y=\"", y, "\" class=\"name\">", xmlEscape(p.name), " ",
                           shapeText(p.shape), " ", roleName(p.role), "</text>\n");
    y += kLine;
    body += detail::concat("<text x=\"10\" y=\"", y, "\">", xmlEscape(placementText(p)),
                           p.layoutShape() != p.shape ? xmlEscape("; drawn with its pad rows " + shapeText(p.layoutShape())) : "",
                           p.shape.size() == 3 ? "; columns: dims 1 and 2 flattened" : "", "</text>\n");
    y += kLine + 14;  // room for the column labels
    const int top = y;
    auto px = [&](const std::vector<std::int64_t>& bounds, const std::vector<int>& pos, std::int64_t v) {
      return pos[std::size_t(std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin())];
    };
    int lastLabel = -100;
    for (std::size_t i = 0; i < cb.size(); ++i)
      if (kLeft + cp[i] - lastLabel >= 28) {
        lastLabel = kLeft + cp[i];
        body += detail::concat("<text x=\"", lastLabel, "\" y=\"", top - 3, "\" class=\"idx\">", cb[i], "</text>\n");
      }
    lastLabel = -100;
    for (std::size_t i = 0; i < rb.size(); ++i)
      if (top + rp[i] - lastLabel >= 11) {
        lastLabel = top + rp[i];
        body += detail::concat("<text x=\"", kLeft - 4, "\" y=\"", lastLabel + 4, "\" class=\"idx\" text-anchor=\"end\">",
                               rb[i], "</text>\n");
      }
    // Copies of the same box (replicated, partial) side by side as stripes.
    std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>, std::vector<const Rect*>> boxes;
    for (const Rect& r : rects) boxes[{r.r0, r.r1, r.c0, r.c1}].push_back(&r);
    for (const auto& [box, holders] : boxes) {
      const auto [r0, r1, c0, c1] = box;
      const double x0 = kLeft + px(cb, cp, c0), x1 = kLeft + px(cb, cp, c1);
      const double y0 = top + px(rb, rp, r0), y1 = top + px(rb, rp, r1);
      const double stripe = (x1 - x0) / double(holders.size());
      for (std::size_t i = 0; i < holders.size(); ++i) {
        const Rect& r = *holders[i];
        const int rank = grid.rank(r.t, r.g);
        const std::string geometry = detail::concat("x=\"", x0 + stripe * double(i), "\" y=\"", y0, "\" width=\"",
                                                    stripe, "\" height=\"", y1 - y0, "\"");
        body += detail::concat("<rect class=\"block\" ", geometry, " fill=\"", kSvgPalette[rank % 16],
                               "\" data-rank=\"", rank, "\" data-t=\"", r.t, "\" data-g=\"", r.g, "\" data-pad=\"",
                               r.pad ? 1 : 0, "\" data-rows=\"", r0, " ", r1, "\" data-cols=\"", c0, " ", c1,
                               "\"><title>", xmlEscape(rankLabel(grid, r.t, r.g)), r.pad ? " pad rows" : "",
                               "</title></rect>\n");
        if (r.pad) body += "<rect class=\"hatch\" " + geometry + " fill=\"url(#hatch)\"/>\n";
      }
      if (holders.size() == 1 && x1 - x0 >= 24 && y1 - y0 >= 12)
        body += detail::concat("<text x=\"", (x0 + x1) / 2, "\" y=\"", (y0 + y1) / 2 + 4,
                               "\" class=\"lbl\" text-anchor=\"middle\">r", grid.rank(holders[0]->t, holders[0]->g),
                               "</text>\n");
    }
    body += detail::concat("<rect x=\"", kLeft, "\" y=\"", top, "\" width=\"", w, "\" height=\"", h,
                           "\" fill=\"none\" stroke=\"#222\"", p.tp.kind == AxisKind::kPartial ? " stroke-dasharray=\"6 3\"" : "",
                           "/>\n");
    body += detail::concat("<text x=\"", kLeft - 4, "\" y=\"", top + h + 4, "\" class=\"idx\" text-anchor=\"end\">", R,
                           "</text>\n");
    // The per-rank lines beside the drawing, or under it when it is wide.
    int ly = w <= kBoxW - 160 ? top + 10 : top + h + 18;
    const int lx = w <= kBoxW - 160 ? kLeft + w + 16 : kLeft;
    for (const auto& line : rankLines(p, isParameterOrItsGradient(p, params))) {
      body += detail::concat("<text x=\"", lx, "\" y=\"", ly, "\" class=\"rank\">", xmlEscape(line), "</text>\n");
      ly += 13;
    }
    y = std::max(top + h + 10, ly) + 24;
    body += "</g>\n";
  }
  std::string svg = detail::concat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", kWidth,
      "\" height=\"", y, "\" viewBox=\"0 0 ", kWidth, " ", y, "\" font-family=\"DejaVu Sans, Arial, sans-serif\" "
      "font-size=\"12\">\n<defs><pattern id=\"hatch\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
      "patternTransform=\"rotate(45)\"><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#000\" stroke-width=\"2\" "
      "stroke-opacity=\"0.55\"/></pattern>\n<style>.title{font-size:15px;font-weight:bold}.name{font-weight:bold}"
      ".idx{font-size:10px;fill:#444}.rank{font-size:11px;font-family:DejaVu Sans Mono,monospace}"
      ".lbl{font-size:11px;fill:#fff}</style></defs>\n<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n");
  return svg + body + "</svg>\n";
}

}  // namespace tpsim::tools
