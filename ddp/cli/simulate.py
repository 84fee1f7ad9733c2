"""``python -m ddp simulate``: predict one training step's time at other world sizes, from a
measured run or from a configuration described by hand (``ddp.analysis.costmodel``, whose
docstring states the model and its assumptions).

    python -m ddp simulate --from RUN.json --world-sizes 2,8,64,1024 --json OUT.json [--link ib-400g]
    python -m ddp simulate --model pkg.mod:build --batch-size 32 --seq-len 1 --strategies torch \\
        --local-step-ms 97 --measured-step-ms 1:100 --gpus-per-node 8 --link dgx1-v100 --inter-link ib-4x100g
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
    LINKS,
    RANK_VARIATION,
    Compute,
    Machine,
    Overheads,
    Sent,
    calibrate,
    calibrate_on_measured,
    default_overlap_slowdown,
    fit_link,
    fixed_steps_from_pairs,
    parse_link,
    predict_grid,
    recommend_bucket_sizes,
    validation_rows,
)
from ddp.analysis.tables import ms
from ddp.bench.config.options import add_config_options
from ddp.bench.config.parsing import OptionError, argument_type, parse_list, positive_float, positive_ints
from ddp.bench.config.shape import StepShape
from ddp.bench.config.workloads import check_workload
from ddp.bench.results.records import load_run, strategy_label, write_records
from ddp.cli import UsageError
from ddp.strategies.registry import DDP_STRATEGIES, takes_bucket_size, traits


def measured_steps(text: str) -> dict[int, float]:
    """``WS:MS[,WS:MS...]`` -> {world size: seconds}."""
    rows = {}
    for item in parse_list(text, str, "WS:MS pairs"):
        world, _, milliseconds = item.partition(":")
        try:
            world_size, seconds = int(world), float(milliseconds) / 1e3
        except ValueError:
            raise OptionError(f"expected WS:MS pairs such as 1:100,8:104.5, got {item!r}") from None
        if world_size < 1 or not seconds > 0 or world_size in rows:
            raise OptionError(f"expected WS:MS with 1 rank or more, MS above 0, each world size once, got {text!r}")
        rows[world_size] = seconds
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="run", type=Path, default=None, help="a saved run (pytest-benchmark JSON) to calibrate on")
    parser.add_argument("--world-sizes", type=argument_type(lambda t: positive_ints(t, "world sizes"), "world_sizes"),
                        default=(2, 8, 64, 1024), help="ranks to predict (default: 2,8,64,1024)")
    parser.add_argument("--json", type=Path, default=None, help="write the predictions here (a JSON list, every term of each)")
    links = ", ".join(sorted(LINKS))
    parser.add_argument("--link", default=None,
                        help=f"the link inside a node (the job's only link without --gpus-per-node): a preset ({links}) or "
                        "BUSBW_GB_PER_S,LATENCY_US (bus bandwidth as nccl-tests reports it; latency per algorithm step); "
                        "default with --from: fitted on the run's all-reduces")
    parser.add_argument("--inter-link", default=None, help="the link across nodes, with --gpus-per-node: a preset or "
                        "BUSBW_GB_PER_S,LATENCY_US (the bandwidth a node has across nodes)")
    parser.add_argument("--gpus-per-node", type=argument_type(lambda t: positive_ints(t, "GPUs a node")[0], "gpus_per_node"),
                        default=None, help="GPUs a node: ranks beyond it cross --inter-link")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="auto",
                        help="all-reduce algorithm: auto (default: the faster of ring and tree per collective, as NCCL "
                        "picks), ring or tree")
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
                                              "activation_checkpointing": "none", "precision": None, "grad_comm": None},
                       lists=("strategy", "bucket_size_mb"), only_given=True)
    by_hand.add_argument("--local-step-ms", type=argument_type(positive_float, "local_step_ms"), default=None,
                         help="one step without communication, in ms (optional with --measured-step-ms)")
    by_hand.add_argument("--measured-step-ms", type=argument_type(measured_steps, "measured_step_ms"), default=None,
                         help="WS:MS[,WS:MS...]: the first strategy's step (at its first bucket size) as measured at these "
                         "world sizes, in ms: calibrates the fixed cost per step (with --local-step-ms) or the compute")
    parser.add_argument("--collective-overhead-us", type=float, default=None,
                        help="what each collective adds to the step beyond the link, in us (default: the machine's "
                        "small-message all-reduce time at each world size, NCCL's latency; with --from and no "
                        "--link, none: the run's all-reduces already hold it)")
    parser.add_argument("--rank-variation", type=float, default=RANK_VARIATION,
                        help=f"one rank's compute's coefficient of variation between ranks; the step waits for the slowest "
                        f"(default: {RANK_VARIATION:g})")


def _strategy_grid(strategies, bucket_sizes) -> list[tuple[str, float | None]]:
    """In the order given: each strategy at each bucket size it takes."""
    return [(s, float(mb)) if takes_bucket_size(s) else (s, None) for s in strategies
            for mb in (bucket_sizes if takes_bucket_size(s) else (None,))]


def _overlap_slowdown(args, cpu_gloo: bool) -> float:
    return args.overlap_slowdown if args.overlap_slowdown is not None else default_overlap_slowdown(cpu_gloo)


def _collective_source(collective: float | None) -> str:
    if collective is not None:
        return "given (--collective-overhead-us)"
    return "the machine's small-message all-reduce time at each world size (NCCL's latency, per-step latencies of the links)"


def _link(text: str, flag: str):
    try:
        return parse_link(text, flag)
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from None


def _machine(args, fitted=None) -> Machine:
    if args.inter_link is not None and args.gpus_per_node is None:
        raise UsageError("--inter-link joins nodes: give --gpus-per-node too")
    if args.gpus_per_node is not None and args.inter_link is None:
        raise UsageError("--gpus-per-node splits the job into nodes: give --inter-link, the link between them")
    intra = _link(args.link, "--link") if args.link is not None else fitted
    inter = _link(args.inter_link, "--inter-link") if args.inter_link is not None else None
    return Machine(intra, inter, args.gpus_per_node, args.algorithm)


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.optimizer_fraction < 1:
        raise UsageError(f"--optimizer-fraction must be in [0, 1), got {args.optimizer_fraction}")
    if args.overlap_slowdown is not None and args.overlap_slowdown < 0:
        raise UsageError(f"--overlap-slowdown must be 0 or more, got {args.overlap_slowdown}")
    if args.collective_overhead_us is not None and args.collective_overhead_us < 0:
        raise UsageError(f"--collective-overhead-us must be 0 or more, got {args.collective_overhead_us}")
    if args.rank_variation < 0:
        raise UsageError(f"--rank-variation must be 0 or more, got {args.rank_variation}")
    if args.model is not None:
        try:
            check_workload(args.model)
        except ValueError as error:
            raise UsageError(f"--model: {error}") from None
    by_hand = {"--model": args.model, "--local-step-ms": args.local_step_ms, "--batch-size": args.batch_size,
               "--seq-len": args.seq_len, "--measured-step-ms": args.measured_step_ms, "--precision": args.precision,
               "--grad-comm": args.grad_comm}
    if args.run is not None and any(value is not None for value in by_hand.values()):
        given = ", ".join(flag for flag, value in by_hand.items() if value is not None)
        raise UsageError(f"{given} describe a configuration by hand: give them without --from, or drop them")
    calibrated = paired = None
    collective = None if args.collective_overhead_us is None else args.collective_overhead_us * 1e-6
    if args.run is not None:
        run = calibrate(load_run(args.run), args.statistic)
        try:
            check_workload(run.model)
        except ValueError as error:
            raise UsageError(f"{args.run}: {error}") from None
        model = run.model
        computes = run.computes(args.optimizer_fraction)
        strategies = sorted({(s.strategy, s.config.bucket_size_mb) for s in run.steps}, key=lambda s: (s[0], s[1] or 0))
        cpu_gloo = run.backend == "gloo" and run.device == "cpu"
        samples = [s for s in run.allreduce if s[1] == run.world_size] or run.allreduce
        fitted = None
        if args.link is None:
            try:
                fitted = fit_link(samples, "ring", name=f"fitted on {args.run.name}")
            except ValueError as error:
                raise UsageError(f"{args.run}: {error}") from None
        machine, sent = _machine(args, fitted), run.sent
        if collective is None and fitted is not None:
            collective, source = 0.0, f"none beyond the link fitted on {args.run.name}'s all-reduces, which hold their launches"
        else:
            source = _collective_source(collective)
        slowdown = _overlap_slowdown(args, cpu_gloo)
        base = Overheads(0.0, collective, args.rank_variation, source)
        paired = fixed_steps_from_pairs(run, computes, machine, slowdown, base, sent)
        overheads = paired.overheads(base)
    else:
        if args.link is None or None in (args.model, args.batch_size, args.seq_len) or (
                args.local_step_ms is None and args.measured_step_ms is None):
            raise UsageError("without --from, give --link, --model, --batch-size, --seq-len and --local-step-ms or "
                             "--measured-step-ms")
        run, model, slowdown = None, args.model, _overlap_slowdown(args, cpu_gloo=False)
        machine, sent = _machine(args), Sent(args.precision or "fp32", args.grad_comm or "fp32")
        shape = StepShape(args.batch_size, args.seq_len, args.grad_accum, args.activation_checkpointing)
        strategies = _strategy_grid([s for s in args.strategy if traits(s).communicates], args.bucket_size_mb)
        if not strategies:
            raise UsageError("--strategies: none of them communicates; name one that does (torch, bucketed, ...)")
        base = overheads = Overheads(0.0, collective, args.rank_variation, _collective_source(collective))
        if args.measured_step_ms is not None:
            reference = strategies[0]
            calibrated = calibrate_on_measured(
                model, shape, *reference, machine, args.measured_step_ms,
                None if args.local_step_ms is None else args.local_step_ms / 1e3, overheads, 0.0, sent,
            )
            computes, overheads = {(args.batch_size, args.seq_len): calibrated.compute}, calibrated.overheads
        else:
            computes = {(args.batch_size, args.seq_len): Compute.of(args.local_step_ms / 1e3, shape, args.optimizer_fraction)}

    print(f"machine: {machine.describe()}; overlap slowdown {slowdown:g}; model {model}")
    print(f"fixed cost per collective: {base.collective_source}; rank variation {base.rank_variation:g}")
    if paired is not None:
        print(f"fixed cost per step, ms, from the run's local/strategy pairs at {run.world_size} ranks: the mean over the "
              "shapes (each shape's in brackets); each validation row is predicted from the other shapes")
        for key, costs in overheads.items():
            gaps = paired.gaps[key].values()
            print(f"  {strategy_label(*key)} {ms(costs.fixed_step_seconds, 2)} [{', '.join(ms(gap, 2) for gap in gaps)}]")
    if calibrated is not None:
        label = " ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in strategies[0] if x is not None)
        residuals = ", ".join(f"{n}: {ms(r, 2)}" for n, r in calibrated.residuals_seconds.items())
        print(f"calibrated on {label}'s measured steps: compute {ms(calibrated.compute.step_seconds, 2)} ms, fixed cost per "
              f"step {ms(calibrated.overheads.fixed_step_seconds, 2)} ms ({calibrated.solved} solved; residual ms at "
              f"{residuals}); charged to every configuration")

    world_sizes = sorted(set(args.world_sizes) | ({run.world_size} if run else set())
                         | (set(args.measured_step_ms) if args.measured_step_ms else set()))
    predictions = predict_grid(model, computes, strategies, world_sizes, machine, slowdown, overheads, sent)
    not_modelled = sorted({name for name, _ in strategies} - {p.strategy for p in predictions})
    if not_modelled:
        print(f"not modelled (their class gives no communication_schedule): {', '.join(not_modelled)}")
    print(tabulate(
        [[p.world_size, p.batch_size, p.seq_len, p.label, p.collectives_per_step, ms(p.compute_seconds, 1),
          ms(p.fixed_step_seconds, 2), ms(p.fixed_collective_seconds, 2), ms(p.rank_wait_seconds, 2),
          ms(p.comm_seconds, 1), ms(p.exposed_comm_seconds, 2), ms(p.step_seconds, 1)] for p in predictions],
        headers=["ranks", "batch", "seq len", "strategy", "collectives", "compute ms", "fixed step ms",
                 "fixed collectives ms", "rank wait ms", "comm ms", "exposed comm ms", "step ms"],
    ))

    if any(takes_bucket_size(s) for s, _ in strategies) or run is not None:
        recommendations = recommend_bucket_sizes(model, computes, world_sizes, machine, slowdown, overheads=overheads, sent=sent)
        print("\nrecommended bucket size (bucketed; candidates " + ", ".join(f"{mb:g}" for mb in CANDIDATE_BUCKET_SIZES_MB) + " MB)")
        print(tabulate(
            [[r.world_size, r.batch_size, r.seq_len, f"{r.bucket_size_mb:g}", ms(r.step_seconds, 1),
              f"{r.worst_bucket_size_mb:g}", ms(r.worst_step_seconds, 1)] for r in recommendations],
            headers=["ranks", "batch", "seq len", "best bucket MiB", "step ms", "worst bucket MiB", "step ms"],
        ))

    if run is not None:
        held_out = [p for shape, compute in computes.items()
                    for p in predict_grid(model, {shape: compute}, strategies, [run.world_size], machine, slowdown,
                                          paired.overheads(base, leave_out=shape), sent)]
        rows = validation_rows(run, held_out, paired)
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
        plots.plot_scaling(predictions, args.plot, f"ddp simulate: model {model}, link {machine.name}")
        print(f"wrote {args.plot}")
    return 0


def validation_table(rows) -> str:
    return tabulate(
        [[r.batch_size, r.seq_len, r.label, ms(r.measured_step_seconds, 1), ms(r.predicted_step_seconds, 1), f"{r.error:+.1%}",
          ms(r.measured_exposed_comm_seconds, 1), ms(r.predicted_exposed_comm_seconds, 1), r.fixed_step_from] for r in rows],
        headers=["batch", "seq len", "strategy", "measured ms", "predicted ms", "error", "measured exposed comm ms", "predicted exposed ms",
                 "fixed step from"],
    )
