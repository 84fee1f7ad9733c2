"""``python -m ddp simulate``: predict one training step's time at other world sizes from a
measured run (``ddp.analysis.costmodel``, whose docstring states the model and its assumptions).

    python -m ddp simulate --from RUN.json --world-sizes 2,8,64,1024 --json OUT.json [--link ib-400g]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tabulate import tabulate

from ddp.analysis import plots
from ddp.analysis.costmodel import (
    ALGORITHMS,
    CANDIDATE_BUCKET_SIZES_MB,
    GB,
    LINKS,
    Compute,
    Link,
    calibrate,
    default_overlap_slowdown,
    fit_link,
    predict_grid,
    recommend_bucket_sizes,
    validation_rows,
)
from ddp.analysis.tables import ms
from ddp.bench.config.options import add_config_options
from ddp.bench.config.parsing import argument_type, positive_float, positive_ints
from ddp.bench.config.shape import StepShape
from ddp.bench.results.records import load_run, write_records
from ddp.cli import UsageError
from ddp.model import MODEL_SIZES
from ddp.strategies.registry import DDP_STRATEGIES, takes_bucket_size, traits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="run", type=Path, default=None, help="a saved run (pytest-benchmark JSON) to calibrate on")
    parser.add_argument("--world-sizes", type=argument_type(lambda t: positive_ints(t, "world sizes"), "world_sizes"),
                        default=(2, 8, 64, 1024), help="ranks to predict (default: 2,8,64,1024)")
    parser.add_argument("--json", type=Path, default=None, help="write the predictions here (a JSON list)")
    parser.add_argument("--link", choices=sorted(LINKS), default=None, help="a preset link instead of the run's fitted one")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="ring", help="latency term of the all-reduce (default: ring)")
    parser.add_argument("--overlap-slowdown", type=float, default=None,
                        help="seconds of compute lost per second of communication overlapped with backward "
                        "(default: 1 for a gloo-on-CPU run, where both share the cores; 0 otherwise)")
    parser.add_argument("--optimizer-fraction", type=float, default=0.0,
                        help="share of a local step spent in the optimizer (default: 0)")
    parser.add_argument("--statistic", choices=("median", "min"), default="median",
                        help="which statistic of a run's rounds to calibrate and validate on (default: median; min "
                        "shows what the model does with the least-disturbed rounds on a shared machine)")
    parser.add_argument("--plot", type=Path, default=None, help="write the scaling plot (PNG) here")
    parser.add_argument("--validation-json", type=Path, default=None, help="write the validation rows here")
    by_hand = parser.add_argument_group("without --from: a configuration described by hand (needs --link)")
    add_config_options(by_hand.add_argument, {"model": None, "batch_size": None, "seq_len": None, "strategy": DDP_STRATEGIES,
                                              "bucket_size_mb": (1.0, 10.0, 100.0, 1000.0), "grad_accum": 1,
                                              "activation_checkpointing": "none"}, lists=("strategy", "bucket_size_mb"),
                       only_given=True)
    by_hand.add_argument("--local-step-ms", type=argument_type(positive_float, "local_step_ms"), default=None,
                         help="one step without communication, in ms")


def _strategy_grid(strategies, bucket_sizes) -> list[tuple[str, float | None]]:
    return [(s, float(mb)) for s in strategies if takes_bucket_size(s) for mb in bucket_sizes] + [
        (s, None) for s in strategies if not takes_bucket_size(s)
    ]


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.optimizer_fraction < 1:
        raise UsageError(f"--optimizer-fraction must be in [0, 1), got {args.optimizer_fraction}")
    if args.overlap_slowdown is not None and args.overlap_slowdown < 0:
        raise UsageError(f"--overlap-slowdown must be 0 or more, got {args.overlap_slowdown}")
    by_hand = {"--model": args.model, "--local-step-ms": args.local_step_ms, "--batch-size": args.batch_size,
               "--seq-len": args.seq_len}
    if args.run is not None and any(value is not None for value in by_hand.values()):
        given = ", ".join(flag for flag, value in by_hand.items() if value is not None)
        raise UsageError(f"{given} describe a configuration by hand: give them without --from, or drop them")
    if args.run is not None:
        run = calibrate(load_run(args.run), args.statistic)
        if run.model not in MODEL_SIZES:
            raise UsageError(f"{args.run} benchmarks model {run.model!r}: simulate models the built-in LM sizes only")
        model_size = run.model
        computes = run.computes(args.optimizer_fraction)
        strategies = sorted({(s.strategy, s.config.bucket_size_mb) for s in run.steps}, key=lambda s: (s[0], s[1] or 0))
        cpu_gloo = run.backend == "gloo" and run.device == "cpu"
        samples = [s for s in run.allreduce if s[1] == run.world_size] or run.allreduce
    else:
        if args.link is None or None in (args.model, args.local_step_ms, args.batch_size, args.seq_len):
            raise UsageError("without --from, give --link, --model, --local-step-ms, --batch-size and --seq-len")
        if args.model not in MODEL_SIZES:
            raise UsageError(f"--model {args.model}: simulate models the built-in LM sizes only ({', '.join(MODEL_SIZES)})")
        run, model_size, cpu_gloo, samples = None, args.model, False, []
        shape = StepShape(args.batch_size, args.seq_len, args.grad_accum, args.activation_checkpointing)
        computes = {(args.batch_size, args.seq_len): Compute.of(args.local_step_ms / 1e3, shape, args.optimizer_fraction)}
        strategies = _strategy_grid([s for s in args.strategy if traits(s).communicates], args.bucket_size_mb)

    if args.link is not None:
        preset = LINKS[args.link]
        link = Link(preset.name, preset.latency_seconds, preset.busbw_bytes_per_second, args.algorithm)
    else:
        try:
            link = fit_link(samples, args.algorithm, name=f"fitted on {args.run.name}")
        except ValueError as error:
            raise UsageError(f"{args.run}: {error}") from None
    slowdown = args.overlap_slowdown if args.overlap_slowdown is not None else default_overlap_slowdown(cpu_gloo)
    print(
        f"link {link.name}: alpha {link.latency_seconds * 1e6:.2f} us per step ({link.algorithm}), "
        f"busbw {link.busbw_bytes_per_second / GB:.3f} GB/s; overlap slowdown {slowdown:g}; model {model_size}"
    )

    world_sizes = sorted(set(args.world_sizes) | ({run.world_size} if run else set()))
    predictions = predict_grid(model_size, computes, strategies, world_sizes, link, slowdown)
    not_modelled = sorted({name for name, _ in strategies} - {p.strategy for p in predictions})
    if not_modelled:
        print(f"not modelled (their class gives no communication_schedule): {', '.join(not_modelled)}")
    print(tabulate(
        [[p.world_size, p.batch_size, p.seq_len, p.label, p.collectives_per_step,
          ms(p.comm_seconds, 1), ms(p.exposed_comm_seconds, 1), ms(p.step_seconds, 1)] for p in predictions],
        headers=["ranks", "batch", "seq len", "strategy", "all-reduces", "comm ms", "exposed comm ms", "step ms"],
    ))

    recommendations = recommend_bucket_sizes(model_size, computes, world_sizes, link, slowdown)
    print("\nrecommended bucket size (bucketed; candidates " + ", ".join(f"{mb:g}" for mb in CANDIDATE_BUCKET_SIZES_MB) + " MB)")
    print(tabulate(
        [[r.world_size, r.batch_size, r.seq_len, f"{r.bucket_size_mb:g}", ms(r.step_seconds, 1),
          f"{r.worst_bucket_size_mb:g}", ms(r.worst_step_seconds, 1)] for r in recommendations],
        headers=["ranks", "batch", "seq len", "best bucket MiB", "step ms", "worst bucket MiB", "step ms"],
    ))

    if run is not None:
        rows = validation_rows(run, predictions)
        print(f"\nvalidation at the run's {run.world_size} ranks: measured {args.statistic} against predicted")
        print(validation_table(rows))
        errors = [abs(r.error) for r in rows if traits(r.strategy).communicates]
        if errors:
            within = sum(e <= 0.15 for e in errors)
            print(f"{within} of {len(errors)} communicating configurations within 15%; median |error| {statistics.median(errors):.1%}")
        if args.validation_json:
            write_records(args.validation_json, rows)

    if args.json is not None:
        write_records(args.json, predictions)
        print(f"wrote {len(predictions)} predictions to {args.json}")
    if args.plot is not None:
        plots.plot_scaling(predictions, args.plot, f"ddp simulate: model {model_size}, link {link.name}")
        print(f"wrote {args.plot}")
    return 0


def validation_table(rows) -> str:
    return tabulate(
        [[r.batch_size, r.seq_len, r.label, ms(r.measured_step_seconds, 1), ms(r.predicted_step_seconds, 1), f"{r.error:+.1%}",
          ms(r.measured_exposed_comm_seconds, 1), ms(r.predicted_exposed_comm_seconds, 1)] for r in rows],
        headers=["batch", "seq len", "strategy", "measured ms", "predicted ms", "error", "measured exposed comm ms", "predicted exposed ms"],
    )
