"""The `fp8-reload` commands, one module (or package) each; nothing outside `tools` imports them.

    cli            argparse wiring only
    demo           upstream vs fixed reloads, side by side
    checkpoint     write-checkpoint
    gate/          the accuracy gate
    profile/       reload / forward scenarios under Nsight Systems or torch.profiler
    bench_kernels/ the MoE forward kernels on a GPU, timed and checked
    report/        tables and plots from asv results
    regress        the asv suite on two commits, exit 1 on a slowdown
    rebalance      expert-parallel rebalance across ranks, checked on every rank
    markdown       the tools' one Markdown table writer
"""
