"""`fp8-reload profile`: scenarios under Nsight Systems or torch.profiler, summarized by range.

    workload  the model, checkpoint and inputs a scenario runs
    events    ranges and work (kernels, copies, ops); the Chrome trace loader
    nsys      Nsight Systems commands and its SQLite export
    analyze   nesting, attribution to the innermost range, the summary tables
    overhead  what the ranges cost with no tool attached
    options   its command-line options (light: the CLI imports them for --help)
    command   the command itself, and the worker process nsys records

The summary, per scenario and range: count, total (inclusive) and self time,
share of the scenario, payload total (bytes, tokens, experts: see
`trace.RANGES`), and the work launched inside the range: CUDA kernels and
memcpys (attributed through the launching API call, on the range's thread), or
on a CPU-only trace the top-level aten ops. A second table lists that work per
innermost range.
"""

from .analyze import analyze, innermost, load_events, nest, write_summary
from .command import command, worker_command
from .events import Events, Range, Work, attach_payloads, load_chrome_trace, short_kernel_name
from .nsys import load_nsys_sqlite, nsys_commands
from .options import SCENARIOS, add_arguments
from .overhead import measure_overhead
from .workload import Workload

__all__ = ["Events", "Range", "SCENARIOS", "Work", "Workload", "add_arguments", "analyze",
           "attach_payloads", "innermost", "load_chrome_trace", "load_events", "load_nsys_sqlite",
           "command", "measure_overhead", "nest", "nsys_commands", "short_kernel_name",
           "worker_command", "write_summary"]
