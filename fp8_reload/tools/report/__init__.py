"""Tables and plots from asv results: the headline figures of the reload suite.

Reads asv's results directory (``results/asv``: ``benchmarks.json`` plus
``<machine>/machine.json`` and ``<machine>/<commit>-<env>.json``) into one tidy
pandas frame (one row per benchmark x parameter set), then derives:

* the headline figures with their targets (filtered vs upstream-style reload,
  full reload vs a plain read+copy baseline and vs one pinned host-to-device copy of the
  checkpoint (judged only when measured in the same run), fixed vs upstream post-processing,
  reload device-memory peak), as Markdown and CSV with the machine's info;
* ``reload_vs_fraction.png``: reload time against the share of experts reloaded,
  fixed vs scan-all vs upstream-style vs the plain read+copy;
* ``forward_tflops.png``: MoE layer forward throughput per backend against tokens.

asv compares times (lower is better); throughput is computed only here.
pandas and matplotlib are imported on use.

    load    asv's results directory -> one pandas frame
    tables  headline figures against targets, forward and block-scale tables
    plots   reload_vs_fraction.png, forward_tflops.png
    write   headline.md and the CSV files
    rebalance  expert-parallel tables: rebalance vs the link's bound, EP forward balance
"""

from .load import load_results, machine_info
from .tables import (
                     TARGET_FILTERED_SPEEDUP,
                     TARGET_FULL_VS_RAW,
                     TARGET_PROCESS_SPEEDUP,
                     forward_table,
                     fraction_value,
                     headline,
                     scales_table,
)
from .write import command, format_markdown, write_report

__all__ = ["TARGET_FILTERED_SPEEDUP", "TARGET_FULL_VS_RAW", "TARGET_PROCESS_SPEEDUP", "command",
           "format_markdown", "forward_table", "fraction_value", "headline", "load_results",
           "machine_info", "scales_table", "write_report"]
