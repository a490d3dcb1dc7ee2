"""What the lent H200 host is made of, and whether where memory lives moves the reload's limits.

    python3 gpu/host_topology.py [--gib 1.74]

The host-bound figures of issues 13 and 14 moved 20-160% between lent hosts with the same
code. This prints what could explain it, then measures on each NUMA node this process may
run on (one pass when there is one):

* topology: CPU model and clocks, the cores this process may use, the NUMA nodes and their
  memory, the GPU's node (`/sys/bus/pci/devices/<bus id>/numa_node`), the cgroup's CPU quota
  and how often it throttled (`cpu.max`, `cpu.stat`), the kernel's CPU pressure;
* per node (this thread and the readers bound to its cores, pinned buffers allocated and
  touched there): one pinned host-to-device copy, one device-to-host, both at once, and 16
  threads of 64 MiB `preadv` from the page cache into the pinned buffer, with the cgroup's
  throttled time across the read.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fp8_reload.testing import io_paths  # noqa: E402

GiB = 1 << 30


def read(path: str, default: str = "-") -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


def cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def nodes() -> dict[int, set[int]]:
    found = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        found[int(d.name[4:])] = cpulist(read(str(d / "cpulist"), ""))
    return found


def throttled() -> tuple[int, int]:
    """(times throttled, microseconds throttled) of this cgroup (v2), (-1, -1) if unknown."""
    stat = dict(line.split() for line in read("/sys/fs/cgroup/cpu.stat", "").splitlines() if " " in line)
    return int(stat.get("nr_throttled", -1)), int(stat.get("throttled_usec", -1))


def topology() -> None:
    cpuinfo = read("/proc/cpuinfo", "")
    lines = cpuinfo.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    mhz = [float(line.split(":", 1)[1]) for line in lines if line.startswith("cpu MHz")]
    allowed = os.sched_getaffinity(0)
    print(f"[host] {platform.node()} kernel {platform.release()}; {model}; {os.cpu_count()} CPUs online, "
          f"{len(allowed)} allowed: {sorted(allowed)}")
    if mhz:
        print(f"[host] cpu MHz now: min {min(mhz):.0f}, median {statistics.median(mhz):.0f}, "
              f"max {max(mhz):.0f}")
    print(f"[host] governor {read('/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor')}, "
          f"cgroup cpu.max {read('/sys/fs/cgroup/cpu.max')!r}, cpu.stat throttled {throttled()}")
    print(f"[host] /proc/pressure/cpu: {read('/proc/pressure/cpu')!r}")
    for n, cpus in nodes().items():
        mem = read(f"/sys/devices/system/node/node{n}/meminfo", "")
        total = next((line.split()[-2] for line in mem.splitlines() if "MemTotal" in line), "?")
        free = next((line.split()[-2] for line in mem.splitlines() if "MemFree" in line), "?")
        print(f"[node {n}] cpus {len(cpus)} ({len(cpus & allowed)} allowed here), MemTotal {total} kB, "
              f"MemFree {free} kB")
    try:  # nvidia-smi's 00000000:19:00.0 is sysfs's 0000:19:00.0
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.strip()[-12:].lower()
    except (OSError, subprocess.SubprocessError):
        bus = "?"
    pci = f"/sys/bus/pci/devices/{bus}"
    print(f"[gpu] {torch.cuda.get_device_name(0)} at {bus}: numa_node {read(pci + '/numa_node')}, "
          f"local cpus {read(pci + '/local_cpulist')}, link {read(pci + '/current_link_speed')} "
          f"x{read(pci + '/current_link_width')}")
    for cmd in (["nvidia-smi", "topo", "-m"], ["numactl", "--hardware"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            out = f"({exc})"
        print(f"[{' '.join(cmd)}]\n{out.rstrip()}")


def timed(fn, repeat: int = 5) -> float:
    """Median ms of `fn()` (each ends in a sync)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(label: str, nbytes: int, files: list[str]) -> None:
    h2d = io_paths.PinnedCopy(nbytes, "cuda")
    both = io_paths.DuplexCopy(nbytes, "cuda")

    def d2h():
        both.back.copy_(both.old, non_blocking=True)
        torch.cuda.synchronize()

    buf = io_paths.pinned(io_paths.total_bytes(files))
    gb = nbytes / 1e9
    rows = {"H2D": timed(h2d), "D2H": timed(d2h), "both ways": timed(both)}
    before = throttled()
    rows["page cache, 16 threads"] = timed(lambda: io_paths.page_cache_read(files, buf))
    after = throttled()
    text = ", ".join(f"{k} {v:.1f} ms ({gb / v * 1e3:.1f} GB/s)" for k, v in rows.items())
    print(f"[{label}] {text}; throttled during the reads: {after[0] - before[0]} times, "
          f"{(after[1] - before[1]) / 1e3:.1f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.74)
    args = ap.parse_args()
    topology()
    nbytes = int(args.gib * GiB)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        files = []
        for i in range(4):  # page-cached files of the same total size as v2-lite:4
            f = Path(tmp) / f"shard{i}.bin"
            with open(f, "wb") as fh:
                fh.write(os.urandom(1 << 20) * (nbytes // 4 >> 20))
            files.append(str(f))
        # just written, so in the page cache (a first slow read is one of the median's 5);
        # each `measure` pins its own buffers: on a node of its own, first touch places them
        every = os.sched_getaffinity(0)
        placed = {n: c & every for n, c in nodes().items() if c & every}
        measure("all allowed cores", nbytes, files)
        for n, cpus in placed.items() if len(placed) > 1 else ():
            os.sched_setaffinity(0, cpus)  # new reader threads inherit it; first touch lands here
            try:
                measure(f"node {n}, {len(cpus)} cores", nbytes, files)
            finally:
                os.sched_setaffinity(0, every)
        if len(placed) <= 1:
            print(f"[numa] one node among the allowed cores ({sorted(placed)}): nothing to place")


if __name__ == "__main__":
    main()
