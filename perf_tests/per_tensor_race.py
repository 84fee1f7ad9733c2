"""``bucketed`` against PyTorch's DDP where tensors are many: the race of ``ddp versus`` (local, bucketed
and torch in the same rounds, rotating order) over models of 10, 100 and 1,000 small tensors
(``ddp.bench.config.workloads``' ``tensors-N``), world sizes 1 and 2, bucket caps 1 and 25 MiB,
each ratio bucketed / torch with its paired 95% interval (docs/strategies.md, docs/results.md):

    python perf_tests/per_tensor_race.py --out per-tensor-race
    python perf_tests/per_tensor_race.py --contenders sharded_optimizer,zero --world-sizes 2 --out zero-race

A host-bound step: a model of width 64 trains in a few milliseconds, most of them launches and
hooks, which is where a strategy's Python per gradient shows. Every race also checks that bucketed
and torch trained the same weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tabulate import tabulate  # noqa: E402

from ddp.bench.config.options import RoundOptions  # noqa: E402
from ddp.bench.rounds.allreduce import bind_cores  # noqa: E402
from ddp.bench.rounds.race import race  # noqa: E402
from ddp.launcher import RankGroup  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", default="10,100,1000", type=lambda t: [int(x) for x in t.split(",")])
    parser.add_argument("--world-sizes", default="1,2", type=lambda t: [int(x) for x in t.split(",")])
    parser.add_argument("--caps", default="1,25", type=lambda t: [float(x) for x in t.split(",")])
    parser.add_argument("--contenders", default="bucketed,torch", type=lambda t: t.split(","),
                        help="two strategies: the first raced against the second (default bucketed,torch)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of rounds per race (default 20)")
    parser.add_argument("--bind-cores", action="store_true",
                        help="bind each rank to its share of the cores while racing, as MPI launchers do "
                             "(ddp.launcher.bind_to_cores): two unbound ranks' gloo threads meeting on one core "
                             "make a sub-millisecond all-reduce scatter by 5x from round to round")
    parser.add_argument("--out", type=Path, default=Path("per-tensor-race"))
    args = parser.parse_args()
    if len(args.contenders) != 2:
        parser.error(f"--contenders takes two strategies, such as bucketed,torch; got {','.join(args.contenders)}")
    mine, theirs = args.contenders
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty: give a new --out (nothing saved is overwritten)")
    args.out.mkdir(parents=True, exist_ok=True)
    # At least 60 rounds, more until the race's seconds are spent: a step of a few ms scatters by
    # +-10% from one round to the next on a 2-core machine.
    policy = RoundOptions(min_rounds=60, max_rounds=2000, warmup_rounds=3, target_precision=0.0,
                          budget_seconds=args.seconds)
    rows, records = [], []
    began = time.perf_counter()
    for world_size in args.world_sizes:
        with RankGroup(world_size, "gloo") as group:
            group.run(bind_cores, args.bind_cores)
            for tensors in args.tensors:
                for cap in args.caps:
                    values = {"model": f"tensors-{tensors}", "batch_size": args.batch_size, "seq_len": 1,
                              "bucket_size_mb": cap}
                    result = race(group, values, policy, args.contenders)
                    record = result.record
                    low, high = record.ratio_over_reference_ci95[mine]
                    local = record.step_seconds["local"]
                    rows.append([tensors, world_size, f"{cap:g}", len(record.round_seconds["local"]),
                                 f"{local * 1e3:.2f}",
                                 f"+{(record.step_seconds[mine] / local - 1):.1%}",
                                 f"+{(record.step_seconds[theirs] / local - 1):.1%}",
                                 f"{record.ratio_over_reference[mine]:.3f} [{low:.3f}, {high:.3f}]",
                                 "same" if result.weights_differ is None else f"DIFFER: {result.weights_differ}"])
                    records.append(asdict(record))
                    print(tabulate([rows[-1]], disable_numparse=True, tablefmt="plain"), flush=True)
    headers = ["tensors", "world size", "cap (MiB)", "rounds", "local: median (ms)", f"{mine} over local (medians)",
               f"{theirs} over local (medians)", f"{mine} / {theirs}: paired median [95%]", "weights"]
    table = tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)
    command = "python " + " ".join([sys.argv[0], *sys.argv[1:]])
    (args.out / "race.md").write_text(f"Command: `{command}`\n\nWall time: {time.perf_counter() - began:.0f} s\n\n{table}\n")
    (args.out / "races.json").write_text(json.dumps(records, indent=1, default=str))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
