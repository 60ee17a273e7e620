"""The `bench` and `tune` subcommands' flags. Only argparse here: the tools' modules (numpy,
the load generator) are imported when a command runs, not when `servewell serve` starts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_CONCURRENCY = "1,2,4,8,16"
#: A step bounded only by --requests still ends after this long.
REQUESTS_ONLY_DURATION_S = 600.0


def _run_bench(args: argparse.Namespace) -> int:
    from servewell.perf.bench_command import run_bench

    return run_bench(args)


def _run_tune(args: argparse.Namespace) -> int:
    from servewell.perf.tune_command import run_tune

    return run_tune(args)


def port(text: str) -> int:
    """A TCP port flag (argparse names the type in its error)."""
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1 to 65535)")
    return port


def seconds(text: str) -> float:
    """A positive duration flag, up to a day."""
    value = float(text)
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 86400] seconds")
    return value


def add_load_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """--load-timeout-s of the server the command starts (a large model on a busy machine needs longer)."""
    parser.add_argument("--load-timeout-s", type=seconds, default=None,
                        help="for the server this command starts: a model whose load and warm-up take longer is "
                        "failed (default: the server's own; a large model on a busy machine may need more)")


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by bench and tune: protocol, inputs, request bounds."""
    parser.add_argument("--protocol", choices=("http", "grpc"), default=None,
                        help="protocol (default: from the URL; http for a model directory)")
    parser.add_argument("--format", dest="fmt", choices=("json", "binary"), default="json",
                        help="HTTP body: JSON tensors, or the binary tensor extension (default: json)")
    parser.add_argument("--input", dest="npy", action="append", default=[], metavar="NAME=FILE.npy",
                        help="an input's data from a .npy file (repeatable; a bare FILE.npy for a one-input model)")
    parser.add_argument("--image", dest="images", action="append", default=[], type=Path, metavar="FILE",
                        help="an encoded image sent as BYTES to the model's image input (repeatable; used in turn)")
    parser.add_argument("--image-input", default=None, help="the input images go to (default: the one the "
                        "server names, else the only input)")
    parser.add_argument("--batch-size", type=int, default=1, help="rows per request (default: 1)")
    parser.add_argument("--shape", dest="shapes", action="append", default=[], metavar="NAME:D1,D2,...",
                        help="full shape of a generated input (repeatable; default: -1 dims become --batch-size "
                        "for the batch dimension and --dynamic-size for the others)")
    parser.add_argument("--dynamic-size", type=int, default=8,
                        help="size of generated variable dimensions (default: 8)")
    parser.add_argument("--timeout-ms", type=float, default=10_000.0,
                        help="a request unanswered after this long counts as status 'timeout' (default: 10000)")
    parser.add_argument("--header", dest="headers", action="append", default=[], metavar="NAME:VALUE",
                        help="extra request header or gRPC metadata, e.g. 'Authorization: Bearer KEY' (repeatable)")
    parser.add_argument("--seed", type=int, default=1, help="seed of generated data and arrivals (default: 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines (the results are still printed)")


BENCH_DESCRIPTION = (
    "Closed-loop concurrency sweep or open-loop request-rate sweep against any OIP v2 server (servewell, "
    "Triton, MLServer) over HTTP (JSON or binary tensors) or gRPC. TARGET is a URL or a model directory "
    "(or repository), which gets its own `servewell serve` on a free port for the length of the run."
)


def add_bench_parser(sub: Any) -> None:
    """Register `servewell bench` on the CLI's subparsers."""
    p = sub.add_parser("bench", help="load-test any OIP v2 server: throughput and p50/p90/p99 per step",
                       description=BENCH_DESCRIPTION)
    p.add_argument("target", help="http://HOST:PORT, grpc://HOST:PORT, or a model directory / repository to serve")
    p.add_argument("--model", default=None, help="model name (default: the server's only model)")
    p.add_argument("--model-version", default=None, help="model version (default: the server's choice)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="closed loop: comma-separated client counts, one step each "
                      f"(default: {DEFAULT_CONCURRENCY})")
    load.add_argument("--rate", default=None,
                      help="open loop: comma-separated request rates (Poisson arrivals), one step each")
    p.add_argument("--idle-ms", default=None,
                   help="closed loop: after the steps, one client waiting this many ms after each answer, one step "
                   "per comma-separated value (what a request that finds the server idle costs; servewell plan "
                   "reads it), e.g. 2,5,20")
    p.add_argument("--duration-s", type=float, default=None,
                   help=f"seconds per step (default: 10; with --requests only: up to {REQUESTS_ONLY_DURATION_S:g})")
    p.add_argument("--requests", type=int, default=None, help="at most this many requests per step")
    p.add_argument("--warmup-s", type=float, default=1.0,
                   help="requests in each step's first seconds are sent but not measured (default: 1)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="open loop: requests in flight at most; arrivals beyond are counted as client_saturated")
    p.add_argument("--out", type=Path, default=None,
                   help="write results.json, results.csv and latency_vs_throughput.png into this directory")
    p.add_argument("--no-plot", action="store_true", help="with --out: skip the PNG (no matplotlib needed)")
    p.add_argument("--port", type=port, default=None,
                   help="with a model directory: the HTTP port of the server bench starts (default: a free one)")
    p.add_argument("--grpc-port", type=port, default=None,
                   help="with a model directory: the gRPC port of the server bench starts (default: a free one "
                   "with --protocol grpc, else no gRPC listener)")
    add_load_timeout_argument(p)
    add_load_arguments(p)
    p.set_defaults(run=_run_bench)




def add_perf_parsers(sub: Any) -> None:
    """Register `servewell bench` and `servewell tune` on the CLI's subparsers."""
    add_bench_parser(sub)
    add_tune_parser(sub)


TUNE_DESCRIPTION = (
    "Serve MODEL_DIR with candidate settings (max batch size, batching policy and wait, instances x threads, "
    "dtype for torch runtimes), measure each with closed-loop steps of rising concurrency, and recommend the "
    "setting with the highest throughput whose p99 meets --slo-p99-ms, with the model.yaml block to paste. "
    "Batching changes are applied live; the others restart a server on a temporary copy of the model "
    "directory (yours is never written). Bounded by --budget-s; rerunning with the same --out resumes."
)


def add_tune_parser(sub: Any) -> None:
    """Register `servewell tune` on the CLI's subparsers."""
    p = sub.add_parser("tune", help="find the settings with the highest throughput within a p99 SLO",
                       description=TUNE_DESCRIPTION)
    p.add_argument("model_dir", help="the model's directory (with its model.yaml)")
    p.add_argument("--slo-p99-ms", type=float, required=True, help="p99 latency target in milliseconds")
    p.add_argument("--budget-s", type=float, default=300.0, help="time for the whole search (default: 300)")
    p.add_argument("--out", type=Path, default=None, help="results, plot and the resumable state file "
                   "(default: ./servewell-tune-MODEL)")
    p.add_argument("--step-s", type=float, default=3.0, help="seconds of load per ladder step (default: 3)")
    p.add_argument("--warmup-s", type=float, default=0.5, help="unmeasured start of each step (default: 0.5)")
    p.add_argument("--max-concurrency", type=int, default=128, help="most clients a ladder climbs to (default: 128)")
    p.add_argument("--batch-sizes", default=None, help="max batch sizes to try (default: powers of two up to "
                   "the configured max_batch_size)")
    p.add_argument("--waits-ms", default=None, help="window waits to try, ms (default: 2,5,10; only those "
                   "under a quarter of the SLO)")
    p.add_argument("--dtypes", default=None, help="dtypes to try for torchscript/pytorch models (default: auto)")
    p.add_argument("--no-instances", action="store_true", help="keep instances and threads as configured "
                   "(batching only: no restarts)")
    p.add_argument("--cores", type=int, default=None, help="CPUs instances x threads may use (default: all usable)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each of the two best, to show the noise "
                   "(default: 2)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    add_load_timeout_argument(p)
    add_load_arguments(p)
    p.set_defaults(run=_run_tune)
