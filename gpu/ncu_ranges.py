"""Summarize `ncu --csv --page raw` output (stdin): kernels per innermost fp8_reload range.

Nsight Compute prints, per profiled kernel, the NVTX push/pop stack of the launching
thread ("thread Domain:Push/Pop_Range:..." column). We print every (innermost
fp8_reload range, kernel) pair with its count, so a filtered capture shows which
kernels fell inside the requested range.
"""

import collections
import csv
import re
import sys

rows = [r for r in csv.reader(sys.stdin) if r]
start = next((i for i, r in enumerate(rows) if r[:2] == ["ID", "Process ID"]), None)
if start is None:
    print("  no kernels profiled (no CSV table in ncu's output)")
    sys.exit(0)
hdr = rows[start]
kcol = next(i for i, h in enumerate(hdr) if h.startswith("Kernel Name"))
ncol = next(i for i, h in enumerate(hdr) if "Push/Pop" in h)
data = [r for r in rows[start + 2:] if len(r) == len(hdr) and r[0].isdigit()]
pairs = collections.Counter()
for r in data:
    stack = re.findall(r"fp8_reload:(fp8_reload/[^:]+):", r[ncol])
    pairs[(" > ".join(s.removeprefix("fp8_reload/") for s in stack[-3:]) or "-", r[kcol][:70])] += 1
print(f"  {len(data)} kernels profiled")
for (stack, kernel), n in pairs.most_common(14):
    print(f"  {n:4d}  [{stack}]  {kernel}")
