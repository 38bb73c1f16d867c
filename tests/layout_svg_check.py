#!/usr/bin/env python3
"""Checks a `tpsim layout --svg` page with a real XML parser: it is well-formed SVG with the hatch
pattern and a legend, and in every tensor panel the rank blocks (their data-rows / data-cols ranges)
cover each element exactly data-copies times: once for a sharded tensor, once per copy for a
replicated or partial one. usage: layout_svg_check.py FILE.svg [TENSOR ...] (tensors that must appear)"""
import sys
import xml.etree.ElementTree as ET

NS = "{http://www.w3.org/2000/svg}"


def fail(message):
    print(f"layout_svg_check: {message}")
    sys.exit(1)


def main():
    root = ET.parse(sys.argv[1]).getroot()
    if root.tag != NS + "svg":
        fail(f"root element is {root.tag}, expected svg")
    if root.find(f".//{NS}pattern[@id='hatch']") is None:
        fail("no <pattern id='hatch'> for the padding")
    panels = [g for g in root.iter(NS + "g") if g.get("class") == "panel"]
    if not panels:
        fail("no tensor panels")
    names = [p.get("data-tensor") for p in panels]
    for want in sys.argv[2:]:
        if want not in names:
            fail(f"no panel for {want}; panels: {names}")
    pads = 0
    for panel in panels:
        name = panel.get("data-tensor")
        rows, cols, copies = (int(panel.get(k)) for k in ("data-rows", "data-cols", "data-copies"))
        blocks = [r for r in panel.iter(NS + "rect") if r.get("class") == "block"]
        if not blocks:
            fail(f"{name}: no blocks")
        boxes = []
        for b in blocks:
            r0, r1 = map(int, b.get("data-rows").split())
            c0, c1 = map(int, b.get("data-cols").split())
            if not (0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols):
                fail(f"{name}: block rows [{r0}, {r1}) cols [{c0}, {c1}) outside ({rows}, {cols})")
            boxes.append((r0, r1, c0, c1))
            pads += b.get("data-pad") == "1"
        # Count coverage on the grid cut at every block boundary, so large tensors stay cheap.
        rb = sorted({0, rows} | {x for b in boxes for x in b[:2]})
        cb = sorted({0, cols} | {x for b in boxes for x in b[2:]})
        ri = {v: i for i, v in enumerate(rb)}
        ci = {v: i for i, v in enumerate(cb)}
        cover = [[0] * (len(cb) - 1) for _ in range(len(rb) - 1)]
        for r0, r1, c0, c1 in boxes:
            for i in range(ri[r0], ri[r1]):
                for j in range(ci[c0], ci[c1]):
                    cover[i][j] += 1
        for i in range(len(rb) - 1):
            for j in range(len(cb) - 1):
                if cover[i][j] != copies:
                    fail(f"{name}: rows [{rb[i]}, {rb[i + 1]}) cols [{cb[j]}, {cb[j + 1]}) covered "
                         f"{cover[i][j]} times, expected {copies}")
    print(f"layout_svg_check: {len(panels)} panels tile exactly ({pads} pad blocks)")


main()
