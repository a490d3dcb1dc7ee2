"""`fp8-reload profile`: scenarios under Nsight Systems or torch.profiler, summarized by range.

    workload  the model, checkpoint and inputs a scenario runs
    events    ranges and work (kernels, copies, ops); the Chrome trace loader
    nsys      Nsight Systems commands and its SQLite export
    analyze   nesting, attribution to the innermost range, the summary tables
    overhead  what the ranges cost with no tool attached
    options   the scenario, range and tool names (light: the command line imports them)
    command   the command itself, and the worker process nsys records

This package imports none of them: the command line imports `options` for its
help, which must not pull in torch or pandas. Import the module you need.

The summary, per scenario and range: count, total (inclusive) and self time,
share of the scenario, payload total (bytes, tokens, experts: see
`trace.RANGES`), and the work launched inside the range: CUDA kernels and
memcpys (attributed through the launching API call, on the range's thread), or
on a CPU-only trace the top-level aten ops. A second table lists that work per
innermost range.
"""
