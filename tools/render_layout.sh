#!/usr/bin/env bash
# Renders an SVG page of `tpsim layout --svg` to PNG with headless Chromium (Debian's `chromium`
# package), at the page's own size, so the PNG shows what a browser shows.
# usage: tools/render_layout.sh IN.svg OUT.png
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 IN.svg OUT.png" >&2
  exit 2
fi
in=$(realpath "$1")
out=$(realpath -m "$2")
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "$0: chromium not found; install it with 'apt-get install -y chromium'" >&2
  exit 2
fi
# The page size is the root element's width and height attributes.
read -r width height < <(/usr/bin/python3 -c '
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
print(int(float(root.get("width"))), int(float(root.get("height"))))' "$in")
# --no-sandbox: Chromium refuses to run as root (containers, CI) with its sandbox on.
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
  --screenshot="$out" --window-size="$width,$height" "file://$in" 2>/dev/null
[ -s "$out" ] || { echo "$0: chromium wrote no $out" >&2; exit 1; }
echo "rendered $in -> $out (${width}x${height})"
