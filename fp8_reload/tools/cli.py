"""`fp8-reload` command line: argparse wiring only.

Each subcommand is a `command(args) -> int` in its own tools module, imported
when that subcommand runs, so `fp8-reload --help` imports no torch (nor pandas,
nor asv): help answers at once. `main` gives every command the same manners:
a request that cannot be honoured here exits 2 with one line (argparse's code
for a bad option), Ctrl-C exits 130 with one line, neither with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from ..config import MoEConfig
from ..errors import CheckpointError, DeviceUnavailableError
from ..version import __version__
from .profile.options import SCENARIOS, TOOLS
from .usage import UsageError, output_file, work_dir

DESCRIPTION = ("Benchmark, profile and gate hot reloads of FP8 MoE weights the way SGLang's "
               "expert load balancer (EPLB) does them, with the fix for SGLang 0.5.23. "
               "Run `fp8-reload COMMAND --help` for what each command does and its options.")
KINDS = ("fp8", "bf16")
PROCESSING = ("fixed", "upstream", "identity-only")
# The MoE forward backends (fp8_reload.kernels.BACKEND_NAMES; tests check they agree).
MOE_BACKENDS = ("torch", "triton", "deep_gemm", "deep_gemm_masked")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show: flags, and options
    whose help says what happens when they are left out."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default in (argparse.SUPPRESS, []):
            return text
        return super()._get_help_string(action)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def _model_options(p: argparse.ArgumentParser, preset: str) -> None:
    p.add_argument("--preset", default=preset, choices=MoEConfig.PRESETS,
                   help="model shape (tiny: tests, small: CPU benchmarks, v2-lite: DeepSeek-V2-Lite)")
    p.add_argument("--num-layers", type=_int_at_least(2), default=None, metavar="N",
                   help="cut the preset to its first N layers (layer 0 is dense; default: all)")


def _device_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")


def _run(module: str):
    """The handler of a subcommand: `fp8_reload.tools.<module>.command`, imported on call."""
    def handler(args) -> int:
        return importlib.import_module(f"fp8_reload.tools.{module}").command(args)
    return handler


def _sglang_launch(args) -> int:
    from ..sglang_patch.launch import LaunchRefused, launch

    server_args = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    try:
        return launch(server_args, check=args.check)
    except LaunchRefused as e:
        raise UsageError(str(e)) from None


def _command(sub, name: str, summary: str, description: str, handler) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=summary, description=description, formatter_class=HelpFormatter)
    p.set_defaults(func=handler)
    return p


def _demo(sub) -> None:
    d = _command(sub, "demo", "upstream vs identity-only vs fixed reloads, side by side",
                 "Writes a synthetic checkpoint of each kind, loads it once per processing mode "
                 "(upstream: sglang 0.5.23 as shipped; identity-only: its fp8.py half fixed; "
                 "fixed: this project), runs an EPLB filtered reload and a full reload, and "
                 "checks after each whether the Parameters are the same objects, the state "
                 "equals a fresh load bit for bit and the forward is unchanged. Exit 0 when "
                 "fixed passes every check and upstream shows its bugs, 1 otherwise.",
                 _run("demo"))
    _model_options(d, "small")
    _device_option(d)
    d.add_argument("--experts", type=_int_at_least(1), default=2,
                   help="experts per MoE layer the EPLB step reloads")


def _gate(sub) -> None:
    g = _command(sub, "gate", "the accuracy gate: scripted reloads, every step checked; exit 0 "
                 "only if all pass",
                 "Runs a scripted sequence of full and filtered reloads between two checkpoints "
                 "and checks every step, for every MoE backend and checkpoint kind: bitwise "
                 "against a fresh load, numerically against a float32 reference (bounds from "
                 "the versioned bounds file), Parameter identity, untouched experts. Exit 0 if "
                 "every check passed, 1 if one failed, 2 if the gate cannot run as asked.",
                 _run("gate"))
    _model_options(g, "tiny")
    g.add_argument("--processing", default="fixed", choices=PROCESSING,
                   help="post-load processing under test (upstream must fail the gate)")
    g.add_argument("--backend", default="all",
                   help=f"MoE forward backend(s), comma-separated ({', '.join(MOE_BACKENDS)}), "
                        "or all: every one available here")
    g.add_argument("--kind", default="fp8,bf16", help="checkpoint kinds, comma-separated")
    _device_option(g)
    g.add_argument("--bounds", default=None, metavar="TOML",
                   help="bounds file (default: the versioned fp8_reload/kernels/bounds.toml)")
    g.add_argument("--json", default=None, metavar="OUT", type=output_file,
                   help="also write the full results as JSON (default: none)")
    g.add_argument("--workdir", default=None, metavar="DIR", type=work_dir,
                   help="keep the checkpoints here (default: a temporary directory, removed)")


def _write_checkpoint(sub) -> None:
    w = _command(sub, "write-checkpoint", "a synthetic HF-layout checkpoint of any preset",
                 "Writes a deterministic synthetic checkpoint (config.json, safetensors shards, "
                 "index) in the layout of a DeepSeek-V2 FP8 checkpoint, for the other commands, "
                 "the benchmarks or your own experiments.", _run("checkpoint"))
    w.add_argument("out", help="directory to write (created)")
    _model_options(w, "tiny")
    w.add_argument("--kind", choices=KINDS, default="fp8",
                   help="fp8: per-tensor FP8 weights and scales; bf16: quantized on load")
    w.add_argument("--seed", type=int, default=0, help="seed of the weights")


def _rebalance(sub) -> None:
    r = _command(sub, "rebalance", "expert-parallel forward and rebalance across ranks, checked "
                 "on every rank",
                 "Spawns ranks (torch.distributed), loads each rank's share of a checkpoint, runs "
                 "the expert-parallel forward, rebalances the experts for a skewed synthetic load "
                 "by P2P, from disk or both, runs the forward again, and compares every rank's "
                 "state with a fresh load under the new placement and its forward with the "
                 "single-device one.", _run("rebalance"))
    r.add_argument("--world-size", type=int, default=2,
                   help="ranks to spawn (under torchrun: taken from WORLD_SIZE)")
    r.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="torch.distributed backend (default: nccl when there is one GPU per "
                        "rank, else gloo on CPU)")
    r.add_argument("--mode", default="p2p", help="p2p, disk, hybrid, a comma list, or all")
    _model_options(r, "tiny")
    r.add_argument("--kind", default=None,
                   help="checkpoint kind: fp8, bf16 or fp8,bf16 (default: fp8; with --checkpoint, its kind)")
    r.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="use this checkpoint (default: write one to a temporary directory)")
    r.add_argument("--slots-per-rank", type=int, default=None,
                   help="physical expert slots per rank (default: ceil(experts / ranks) + 1)")
    r.add_argument("--exclude-sources", type=int, nargs="*", default=None, metavar="RANK",
                   help="hybrid only: ranks that may not serve experts by P2P, so experts only "
                        "they hold come from disk (default: rank 1, where there is one)")
    r.add_argument("--seed", type=int, default=0, help="seed of the checkpoint and the load")
    r.add_argument("--alpha", type=float, default=1.2, help="Zipf skew of the synthetic load")
    r.add_argument("--tokens", type=int, default=256,
                   help="tokens per rank routed through every MoE layer")
    r.add_argument("--moe-backend", default=None,
                   help="MoE forward backend of the ranks' local experts (default: torch)")
    r.add_argument("--forward-bound", type=float, default=4e-3,
                   help="calc_diff the EP forward may differ from the single-device forward by "
                        "(CROSS_SCHEME_BOUND: ranks quantize activations with their own scales; "
                        "0 demands bitwise equality)")
    r.add_argument("--no-check", action="store_true",
                   help="skip the fresh-load and single-device comparisons")
    r.add_argument("--json", default=None, metavar="OUT", type=output_file,
                   help="also write per-rank results to this JSON file (default: none)")


def _bench_kernels(sub) -> None:
    b = _command(sub, "bench-kernels", "time and check the MoE forward kernels on a GPU",
                 "Times the MoE forward of each backend at the v2-lite shape (CUDA events and "
                 "the profiler's kernel time), DeepGEMM's grouped GEMM and the block-scale "
                 "modes, checks each against the float32 reference, and writes Markdown and "
                 "CSV tables. Needs CUDA; DeepGEMM and Triton compile kernels on first use.",
                 _run("bench_kernels"))
    b.add_argument("--out", default="results/kernels", help="directory for kernels.md and the CSVs")
    b.add_argument("--tokens", default="128,1024,4096", help="comma-separated token counts")
    b.add_argument("--backend", default=",".join(MOE_BACKENDS),
                   help="MoE forward backends to time, comma-separated")
    b.add_argument("--iters", type=_int_at_least(1), default=20, help="timed calls per case")
    b.add_argument("--no-gemm", action="store_true", help="skip the grouped GEMM table")
    b.add_argument("--jit-procs", type=_int_at_least(0), default=0,
                   help="compile every case's kernels first in this many parallel processes "
                        "(default: 0, no separate compile step)")
    b.add_argument("--jit-only", action="store_true", help="only compile (fill the JIT caches)")
    b.add_argument("--jit-extra", action="append", default=[], metavar="PRESET:TOKENS",
                   help="with --jit-only, also compile the GPU backends' kernels for this "
                        "preset and token count (repeatable, default: none), e.g. small:64 for "
                        "the GPU tests")


def _sglang(sub) -> None:
    s = _command(sub, "sglang-launch",
                 "python -m sglang.launch_server ARGS with the FP8 MoE reload fix applied",
                 "Checks the installed sglang, then runs its server with FP8_RELOAD_SGLANG_PATCH=1 "
                 "so every sglang process applies fp8_reload.sglang_patch (docs/sglang-patch.md).",
                 _sglang_launch)
    s.add_argument("--check", action="store_true",
                   help="apply the patch once here, list what it replaces, launch nothing")
    s.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="arguments for sglang.launch_server (after --)")


def add_profile_arguments(p: argparse.ArgumentParser, worker: bool = False) -> None:
    """The options of `fp8-reload profile` (and of its worker process, where --out is optional)."""
    p.add_argument("--out", required=not worker, default=None, metavar="DIR",
                   help="output directory (created)")
    p.add_argument("--scenario", default="all",
                   help=f"{', '.join(SCENARIOS)}, a comma list of them, or all")
    p.add_argument("--tool", choices=TOOLS, default="auto",
                   help="auto: Nsight Systems when nsys is on PATH (torch.profiler if it fails), "
                        "else torch.profiler")
    p.add_argument("--backend", default=None,
                   help=f"MoE forward backend ({', '.join(MOE_BACKENDS)}; default: torch)")
    _model_options(p, "small")
    p.add_argument("--kind", choices=KINDS, default="fp8", help="checkpoint kind")
    _device_option(p)
    p.add_argument("--processing", default="fixed", choices=PROCESSING, help="processing mode")
    p.add_argument("--tokens", type=_int_at_least(1), default=64, help="tokens per forward")
    p.add_argument("--experts", type=_int_at_least(1), default=2,
                   help="experts per MoE layer in reload-filtered")
    p.add_argument("--repeat", type=_int_at_least(1), default=3, help="profiled runs of each scenario")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="an existing checkpoint (default: write one under --out)")
    p.add_argument("--summarize", default=None, metavar="TRACE",
                   help="only summarize an existing trace.json / .sqlite into --out "
                        "(default: profile a new run)")
    p.add_argument("--overhead", action="store_true",
                   help="measure the cost of the ranges with no tool attached instead of profiling")


def _profile(sub) -> None:
    p = _command(sub, "profile", "a reload or forward under Nsight Systems or torch.profiler",
                 "Runs reload and forward scenarios inside named NVTX ranges under Nsight Systems "
                 "(when nsys is on PATH) or torch.profiler, and writes the trace plus a summary "
                 "per range: time, self time, share of the scenario, bytes, and the kernels and "
                 "copies launched inside. Prints where the files are and a short headline.",
                 _run("profile.command"))
    add_profile_arguments(p)


def _report(sub) -> None:
    r = _command(sub, "report", "headline tables, CSV and plots from asv results",
                 "Reads asv's results directory (one subdirectory per machine) and writes the "
                 "headline figures against their targets (headline.md, headline.csv), every "
                 "number (results.csv), the forward and block-scale tables and the plots. Point "
                 "--results at your own asv results to compare your machine with the curated "
                 "ones in results/asv.", _run("report"))
    r.add_argument("--results", action="append", default=None, metavar="DIR",
                   help="asv results directory; repeat it to put machines of several side by side "
                        "(default: results/asv, the curated results)")
    r.add_argument("--out", default="results/report", metavar="DIR",
                   help="where to write tables and plots")
    r.add_argument("--machine", default=None, help="only this asv machine (default: all)")
    r.add_argument("--commit", default=None,
                   help="this commit (hash prefix) instead of each machine's newest run (default: newest)")
    r.add_argument("--stat", choices=("best", "median"), default="best",
                   help="times: each benchmark's best sample (where samples were recorded) or "
                        "asv's median")


def _regress(sub) -> None:
    g = _command(sub, "regress", "the asv suite on two commits; exit 1 on a slowdown",
                 "Runs this checkout's asv suite against the code of BASE and HEAD (git "
                 "worktrees, no environment builds) in several interleaved rounds and exits 1 "
                 "if any benchmark is at least --threshold slower in every round (or fails) in "
                 "HEAD. With --files, BASE and HEAD are two asv result files to compare instead.",
                 _run("regress"))
    g.add_argument("base", help="base commit (or result file with --files)")
    g.add_argument("head", help="head commit (or result file with --files)")
    g.add_argument("--threshold", type=float, default=0.10, help="relative slowdown that fails")
    g.add_argument("-b", "--bench", action="append", default=None, metavar="REGEX",
                   help="asv --bench regex (repeatable; default: the whole suite)")
    g.add_argument("--quick", action="store_true", help="one sample per benchmark (asv --quick)")
    g.add_argument("--launch-method", default="spawn", choices=("spawn", "forkserver"),
                   help="spawn: the one to take numbers with; forkserver: faster start on CPU, "
                        "but fork artifacts distort times (smoke tests only)")
    g.add_argument("--rounds", type=_int_at_least(1), default=3,
                   help="interleaved BASE/HEAD run pairs; a slowdown must show in every one")
    g.add_argument("--machine", default=None, help="asv machine name (default: the only one "
                   "in ~/.asv-machine.json, else fp8-reload-regress)")
    g.add_argument("--keep", default=None, metavar="DIR",
                   help="keep worktrees and results in this directory (default: removed)")
    g.add_argument("--files", action="store_true", help="compare two existing asv result files")
    g.add_argument("--all", action="store_true", help="with --files: list unchanged benchmarks too")
    g.add_argument("asv_args", nargs="*", help="extra `asv run` arguments, after --")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8-reload", description=DESCRIPTION,
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for add in (_demo, _gate, _profile, _bench_kernels, _report, _regress, _rebalance,
                _write_checkpoint, _sglang):
        add(sub)
    return p


class _Terminated(SystemExit):
    """SIGTERM (a CI job's timeout, `kill`) raised as an exception, so that the command ends as
    on Ctrl-C: a reload rolls back and temporary checkpoints are removed on the way out (under
    the default action the process vanished and left them: gigabytes for v2-lite)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated(128 + signum)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no command: a usage error, as argparse treats a missing argument
        parser.print_help(sys.stderr)
        return 2
    name = f"{parser.prog} {args.command}"
    term = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if term is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if getattr(args, "num_layers", None) is not None and getattr(args, "preset", None):
            try:  # before any work: a slice deeper than the preset is refused here, not after it
                MoEConfig.preset(args.preset, num_layers=args.num_layers)
            except ValueError as e:
                raise UsageError(str(e)) from None
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except _Terminated as e:
        print(f"{name}: terminated", file=sys.stderr)
        return e.code
    except (UsageError, DeviceUnavailableError, CheckpointError) as e:  # (a checkpoint given that
        print(f"{name}: error: {e}", file=sys.stderr)  # cannot be read: one line, no traceback)
        return 2
    finally:
        if term is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
