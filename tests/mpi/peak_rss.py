#!/usr/bin/env python3
"""peak_rss.py OUT CMD...: runs CMD (its stdout discarded) and writes its peak resident memory in
KiB to OUT, '{rank}' in OUT replaced by the MPI rank of the launcher that started this process."""
import os
import resource
import subprocess
import sys

out, cmd = sys.argv[1], sys.argv[2:]
code = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
with open(out.replace("{rank}", rank), "w") as f:
    f.write(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\n")
sys.exit(code)
