"""The regression gate's power, measured: how often it catches an injected slowdown, and how often
it cries wolf on unchanged code (docs/regression-gate.md holds the tables and the commands).

    python perf_tests/power_study.py --models tiny,mini --pairs 10 --out power-study

Every run spreads its rounds over the suite's groups of ranks (``--rank-groups``) and runs no traced
steps (the gate reads none).

For each model, runs of ``pytest perf_tests/test_step.py --strategies local,<slowed class>``
(examples/slowed.py, a ``bucketed`` that can wait a share of its median step in a chosen place),
each a fresh pytest process as a user's run is, saved with ``--benchmark-save``:

- ``pairs + 1`` unchanged runs u_0 .. u_N; the unchanged pairs are (u_i, u_i+1);
- for every case (a place and a fraction), one slowed run s_i per unchanged run u_i (i < N, and
  i a multiple of ``--slowed-every``), compared with it: the slowed pair (u_i, s_i). Unchanged runs are reused by every case, and the
  runs are ordered u_0, s_0 of every case, u_1, ... (every model's i-th before any model's next)
  so that the machine's drift falls on all cases and models alike.

``--rejudge STUDY`` runs nothing and judges an earlier study's saved runs again, with the gate as
it is now. By default every run is a plain one, with the suite's default rounds, as two ordinary runs that a
user compares afterwards with ``python -m ddp compare``. With ``--aimed``, every run after u_0 is
taken with ``--benchmark-compare`` against its pair's first run and ``--ddp-fail-slower``, so that
its rounds aim at that decision (``ddp.analysis.compare.AimAtDecision``). Either way each pair is
judged from the saved files by ``ddp.analysis.compare.compare``, the gate itself. A catch is the
slowed class's benchmark judged *slower*; a false alarm is an unchanged pair judged *slower*; for
the ``machine`` case (every configuration slowed alike) a *slower* verdict is the gate blaming the
code for the machine.

The table reports, per model and case: pairs judged slower, machine slower, unchanged and not
resolved, how many were settled at the end (``settled``: the deciding ratio's interval clear of
the threshold's edges), the median raw ratio of the step (what the injected wait cost, as
measured), the median rounds of the new run, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tabulate import tabulate  # noqa: E402

from ddp.analysis.compare import DEFAULT_THRESHOLD, MACHINE_REFERENCE, Decision, _decide, compare, settled  # noqa: E402
from ddp.bench.config.parsing import percent_type  # noqa: E402
from ddp.bench.results.records import load_run  # noqa: E402
from ddp.bench.results.stats import groups_to_decide  # noqa: E402
from examples.slowed import PLACES  # noqa: E402

SLOWED = "examples.slowed:SlowedBucketed"
WARMUP_ROUNDS = 23  # examples.slowed: every configuration calibrates its median step during warm-up
DEFAULT_CASES = "sync:10%,sync:15%,forward:15%,backward:15%,machine:15%"
DEFAULT_SHAPES = {"tiny": (2, 32), "mini": (2, 64)}  # (batch, seq len) per rank


@dataclass(frozen=True)
class Case:
    place: str
    fraction: float

    @property
    def label(self) -> str:
        return f"{self.fraction:.0%} at {self.place}"

    @property
    def key(self) -> str:
        return f"{self.place}{round(self.fraction * 100)}"


@dataclass
class Pair:
    model: str
    case: str
    index: int
    threshold: float
    verdict: str
    basis: str
    why: str
    settled: bool
    raw_ratio: float
    rounds: int
    run_seconds: float
    groups: int = 1
    """Groups of ranks of the new run (``round_groups``)."""
    groups_to_decide: int | None = None
    """Where not resolved among groups: about how many groups in each run would decide it."""


def parse_cases(text: str) -> list[Case]:
    cases = []
    for item in text.split(","):
        place, _, fraction = item.strip().partition(":")
        if place not in PLACES or not fraction:
            raise SystemExit(f"--cases takes place:percent items such as sync:15% (places: {', '.join(PLACES)}), got {item!r}")
        cases.append(Case(place, percent_type("--cases")(fraction)))
    return cases


class Runner:
    """Runs and saves the pytest runs of one model, and remembers each one's saved file."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.args = args
        self.model = model
        self.storage = ((args.rejudge or args.out) / model / "storage").resolve()
        self.saved: dict[str, Path] = {}
        self.seconds: dict[str, float] = {}
        batch, seq = DEFAULT_SHAPES.get(model, (2, 32))
        self.grid = ["--model", model, "--batch-sizes", str(args.batch_size or batch),
                     "--seq-lens", str(args.seq_len or seq), "--strategies", f"local,{SLOWED}", "--bucket-sizes", "1",
                     "--warmup-rounds", str(WARMUP_ROUNDS), "--traced-steps", "0"]  # the gate reads no traced step
        for flag, value in (("--rounds", args.rounds), ("--max-rounds", args.max_rounds), ("--round-budget", args.round_budget),
                            ("--rank-groups", args.rank_groups)):
            if value is not None:  # else the suite's default, as a user's run has it
                self.grid += [flag, str(value)]

    def run(self, name: str, case: Case | None, compared_with: str | None) -> Path:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_BENCH_SLOWDOWN")}
        if case is not None:
            env.update(DDP_BENCH_SLOWDOWN=str(case.fraction), DDP_BENCH_SLOWDOWN_AT=case.place)
        command = [sys.executable, "-m", "pytest", "perf_tests/test_step.py", "-q", "-p", "no:cacheprovider",
                   *self.grid, f"--benchmark-storage=file://{self.storage}", f"--benchmark-save={name}"]
        if compared_with is not None and self.args.aimed:
            number = self.saved[compared_with].name.split("_", 1)[0]
            command += [f"--benchmark-compare={number}", f"--ddp-fail-slower={self.args.fail_slower}"]
        began = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        self.seconds[name] = time.perf_counter() - began
        if done.returncode not in (0, 1):  # 1: the gate failed, which is a result here
            raise SystemExit(f"run {name} of {self.model} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        (saved,) = self.storage.glob(f"*/*_{name}.json")
        self.saved[name] = saved
        print(f"  {self.model} {name}: {self.seconds[name]:.0f} s", flush=True)
        return saved

    def recall(self, name: str, case: Case | None, compared_with: str | None) -> Path:
        """``--rejudge``: the run ``name`` as the earlier study saved it, and its wall time there."""
        found = list(self.storage.glob(f"*/*_{name}.json"))
        if len(found) != 1:
            raise SystemExit(f"--rejudge: {self.storage} holds {len(found)} runs named {name}: give the study's own "
                             "--models, --pairs and --cases")
        self.saved[name] = found[0]
        index = int(name[1:].split("_", 1)[0])
        label = "unchanged" if case is None else case.label
        self.seconds[name] = next((p["run_seconds"] for p in self.args.earlier_pairs
                                   if (p["model"], p["case"], p["index"]) == (self.model, label, index)), float("nan"))
        return found[0]

    def judge(self, old: str, new: str, case_label: str, index: int) -> list[Pair]:
        """The pair judged at the run's threshold and at every ``--also-judge-at``."""
        pairs = []
        for threshold in [self.args.fail_slower, *self.args.also_judge_at]:
            old_run, new_run = load_run(self.saved[old]), load_run(self.saved[new])
            rows = compare(old_run, new_run, threshold)
            (row,) = [r for r in rows if SLOWED in r.name]
            decision = row.decision
            if self.args.as_one_group:
                decision = one_group_decision(old_run.by_name()[row.name], new_run.by_name()[row.name], threshold)
            verdict = decision.verdict if decision else row.verdict
            new_run = new_run.by_name()[row.name]
            ratio = decision.ratio if decision else None
            needed = None
            if verdict == "not resolved" and decision is not None and min(decision.groups) >= 2:
                needed = groups_to_decide(ratio.point, ratio.low, ratio.high, min(decision.groups))
            pairs.append(Pair(self.model, case_label, index, threshold, verdict, decision.basis if decision else row.basis,
                              decision.why if decision else row.why, decision is not None and settled(decision),
                              decision.raw.point if decision else float("nan"),
                              len(new_run.round_seconds or []), self.seconds[new],
                              decision.groups[1] if decision else 1, needed))
        return pairs


def one_group_decision(old, new, threshold: float) -> Decision:
    """``--as-one-group``: the pair judged as the gate judged before rounds were spread over groups
    of ranks: each run's rounds as one group, and a slowdown called from them (the gate's rules
    without its refusal, ``ddp.analysis.compare.decide``)."""
    return _decide(old.round_seconds, new.round_seconds, threshold, old.record.local_round_seconds,
                   new.record.local_round_seconds, False, None, None)


def study(args: argparse.Namespace, began: float) -> list[Pair]:
    """Every model's i-th runs before any model's (i+1)-th, and the report rewritten after each
    run: a study cut short still holds as many pairs of every model and case."""
    pairs: list[Pair] = []
    runners = [Runner(args, model) for model in args.models]
    for i in range(args.pairs + 1):
        for runner in runners:
            take = runner.recall if args.rejudge else runner.run
            take(f"u{i}", None, f"u{i - 1}" if i else None)
            if i:
                pairs.extend(runner.judge(f"u{i - 1}", f"u{i}", "unchanged", i))
                write_report(args, pairs, began)
            if i == args.pairs or i % args.slowed_every:
                continue
            for case in args.cases:
                take(f"s{i}_{case.key}", case, f"u{i}")
                pairs.extend(runner.judge(f"u{i}", f"s{i}_{case.key}", case.label, i))
                write_report(args, pairs, began)
    return pairs


def table(pairs: list[Pair], threshold: float) -> str:
    """The rates at one threshold, a row per model and case."""
    pairs = [p for p in pairs if p.threshold == threshold]
    rows = []
    for (model, case) in dict.fromkeys((p.model, p.case) for p in pairs):
        group = [p for p in pairs if p.model == model and p.case == case]

        def count(verdict: str) -> int:
            return sum(p.verdict == verdict for p in group)

        meaning = "false alarms" if case == "unchanged" else "blamed on code" if case.endswith("machine") else "caught"
        rows.append([model, case, len(group), f"{count('slower')}/{len(group)} {meaning}", count("machine slower"),
                     count("unchanged"), count("not resolved"), sum(p.settled for p in group),
                     f"x{statistics.median(p.raw_ratio for p in group):.3f}", statistics.median(p.rounds for p in group),
                     statistics.median(p.groups for p in group),
                     ", ".join(str(p.groups_to_decide) for p in group if p.groups_to_decide) or "",
                     f"{statistics.median(p.run_seconds for p in group):.0f}"])
    headers = ["model", "case", "pairs", f"slower (gate at {threshold:.0%})", "machine slower", "unchanged",
               "not resolved", "settled", "median raw new/old", "median rounds", "groups", "groups to decide the open",
               "median run (s)"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def write_report(args: argparse.Namespace, pairs: list[Pair], began: float, finished: bool = False) -> str:
    """power.md (the tables, the command and the wall time so far) and pairs.json (every decision)."""
    rendered = "\n\n".join(table(pairs, threshold) for threshold in [args.fail_slower, *args.also_judge_at])
    return save_report(args, rendered, pairs, began, finished)


def save_report(args: argparse.Namespace, tables: str, pairs: list, began: float, finished: bool) -> str:
    """power.md (``tables``, the command and the wall time so far) and pairs.json (every pair, as saved)."""
    command = "python " + " ".join([sys.argv[0], *sys.argv[1:]])
    state = "Total wall time" if finished else "Unfinished: wall time so far"
    report = f"Command: `{command}`\n\n{state}: {time.perf_counter() - began:.0f} s\n\n{tables}\n"
    (args.out / "power.md").write_text(report)
    (args.out / "pairs.json").write_text(json.dumps([asdict(p) for p in pairs], indent=2))
    return report


# --------------------------------------------------------------------------- default runs

SLOWED_PLUGIN = "examples.slow_registered"
PART = re.compile(r"^run (?P<run>.+?): (?P<parts>.+)$", re.M)


@dataclass
class DefaultPair:
    """One pair of default runs, every benchmark judged by the gate."""

    case: str
    """``unchanged``, or the slowdown injected into the new run (``15% of bucketed``)."""
    index: int
    verdicts: dict[str, int]
    false_alarms: list[str]
    """Benchmarks judged slower that nothing slowed."""
    caught: list[str]
    """Benchmarks of the slowed strategy judged slower."""
    missed: list[str]
    """Benchmarks of the slowed strategy not judged slower, with their verdicts."""
    open: list[str]
    """Benchmarks judged not resolved, with what would decide them (the machine's references, never
    gated, left out)."""
    exit_status: int
    """The new run's pytest exit status (it ran with --benchmark-compare and --ddp-fail-slower)."""
    run_seconds: float
    rounds_share: float | None
    """Timed rounds over the step benchmarks' parts (start-up, builds, warm-up, memory counts, rounds,
    traced steps, predictions), from the run's time by part."""
    parts: str


def rounds_share(stdout: str) -> tuple[float | None, str]:
    """The timed rounds' share of the step benchmarks' parts, and the time-by-part line
    (``run 5 min 52 s: start-up 3 s, builds 4 s, ..., other 1 min 9 s``)."""
    found = PART.search(stdout)
    if found is None:
        return None, ""
    seconds = {}
    for item in found.group("parts").split(", "):
        name = re.sub(r" \d.*$", "", item)
        seconds[name] = sum(int(n) * (60 if unit == "min" else 1) for n, unit in re.findall(r"(\d+) (min|s)\b", item))
    step_parts = ["start-up", "builds", "warm-up", "memory counts", "rounds", "traced steps", "predictions"]
    total = sum(seconds.get(part, 0) for part in step_parts)
    return (seconds.get("rounds", 0) / total if total else None), found.group(0)


def default_runs(args: argparse.Namespace, began: float) -> list[DefaultPair]:
    """u_0 .. u_N default runs (each after the first compared with the one before it, its rounds
    aimed at the decision, as a user's save-change-compare loop runs them), and after every
    ``--slowed-every``-th a run with ``--slow`` slowed by 15% after synchronizing, compared with it.
    Each pair judged again from the saved files by the gate (``ddp.analysis.compare.compare``). With
    ``--rejudge STUDY``, nothing runs: the runs STUDY saved are judged again, up to where it stopped."""
    storage = (args.out / "storage").resolve()
    saved: dict[str, Path] = {}
    pairs: list[DefaultPair] = []

    def run(name: str, compared_with: str | None, slowed: bool) -> tuple[subprocess.CompletedProcess, float]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_BENCH_SLOW")}
        command = [sys.executable, "-m", "pytest", "perf_tests", "-q", "-p", "no:cacheprovider", "-p", SLOWED_PLUGIN,
                   f"--benchmark-storage=file://{storage}", f"--benchmark-save={name}"]
        if slowed:
            env.update(DDP_BENCH_SLOWED=args.slow, DDP_BENCH_SLOWDOWN=str(args.slowdown), DDP_BENCH_SLOWDOWN_AT="sync")
        if compared_with is not None:
            command += [f"--benchmark-compare={saved[compared_with].name.split('_', 1)[0]}",
                        f"--ddp-fail-slower={args.fail_slower}"]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode not in (0, 1):
            raise SystemExit(f"run {name} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        (saved[name],) = storage.glob(f"*/*_{name}.json")
        (args.out / "logs").mkdir(exist_ok=True)
        (args.out / "logs" / f"{name}.log").write_text(done.stdout)
        print(f"  {name}: {seconds:.0f} s, exit {done.returncode}", flush=True)
        return done, seconds

    def recall(name: str, compared_with: str | None, slowed: bool) -> tuple[subprocess.CompletedProcess, float] | None:
        # --rejudge: the run an earlier study saved, its log and its seconds; None where it has none (cut short)
        found, log = sorted((args.rejudge / "storage").glob(f"*/*_{name}.json")), args.rejudge / "logs" / f"{name}.log"
        if not found or not log.is_file():
            return None
        saved[name] = found[0]
        case, index = ("unchanged", int(name[1:])) if name.startswith("u") else (None, int(name[1:]))
        earlier = next((p for p in args.earlier_pairs if p["index"] == index
                        and (p["case"] == "unchanged") == (case == "unchanged")), None)
        status, seconds = (earlier["exit_status"], earlier["run_seconds"]) if earlier else (0, float("nan"))
        return subprocess.CompletedProcess([], status, log.read_text(), ""), seconds

    def judge(old: str, new: str, done: subprocess.CompletedProcess, seconds: float, case: str, index: int) -> None:
        rows = compare(load_run(saved[old]), load_run(saved[new]), args.fail_slower)
        slowed = f"test_step[{args.slow}-" if case != "unchanged" else None
        share, parts = rounds_share(done.stdout)
        verdicts = {}
        for row in rows:
            verdicts[row.verdict] = verdicts.get(row.verdict, 0) + 1
        is_slowed = [row for row in rows if slowed and row.name.startswith(slowed)]
        others = [row for row in rows if row not in is_slowed]
        pairs.append(DefaultPair(
            case, index, verdicts,
            false_alarms=[row.name for row in others if row.verdict == "slower"],
            caught=[row.name for row in is_slowed if row.verdict == "slower"],
            missed=[f"{row.name}: {row.verdict} ({row.basis} x{row.ratio or float('nan'):.3f})" for row in is_slowed
                    if row.verdict != "slower"],
            open=[f"{row.name}: {row.why}" for row in rows if row.verdict == "not resolved" and row.basis != MACHINE_REFERENCE],
            exit_status=done.returncode, run_seconds=seconds, rounds_share=share, parts=parts))
        write_default_report(args, pairs, began)

    take = recall if args.rejudge else run
    for i in range(args.pairs + 1):
        taken = take(f"u{i}", f"u{i - 1}" if i else None, slowed=False)
        if taken is None:
            break
        if i:
            judge(f"u{i - 1}", f"u{i}", *taken, "unchanged", i)
        if i < args.pairs and i % args.slowed_every == 0:
            taken = take(f"s{i}", f"u{i}", slowed=True)
            if taken is None:
                break
            judge(f"u{i}", f"s{i}", *taken, f"{args.slowdown:.0%} of {args.slow}", i)
    return pairs


def write_default_report(args: argparse.Namespace, pairs: list[DefaultPair], began: float, finished: bool = False) -> str:
    rows = []
    for case in dict.fromkeys(p.case for p in pairs):
        group = [p for p in pairs if p.case == case]
        slowed = case != "unchanged"
        rows.append([
            case, len(group),
            sum(bool(p.false_alarms) for p in group), sum(len(p.false_alarms) for p in group),
            f"{sum(len(p.caught) for p in group)}/{sum(len(p.caught) + len(p.missed) for p in group)}" if slowed else "",
            sum(len(p.open) for p in group), sum(o.startswith("test_step[") for p in group for o in p.open),
            sum(p.exit_status == 0 for p in group),
            f"{statistics.median(p.run_seconds for p in group):.0f} ({max(p.run_seconds for p in group):.0f})",
            f"{statistics.median(p.rounds_share for p in group if p.rounds_share is not None):.0%}",
        ])
    headers = ["case", "pairs", "pairs with a false alarm", "false alarms (benchmarks)", "slowed benchmarks caught",
               "not resolved (benchmarks)", "of them step benchmarks", "second run exit 0", "run seconds: median (max)", "rounds' share: median"]
    return save_report(args, tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), pairs, began, finished)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,mini", type=lambda t: t.split(","))
    parser.add_argument("--pairs", type=int, default=10, help="unchanged pairs, and slowed pairs per case (default 10)")
    parser.add_argument("--cases", type=parse_cases, default=parse_cases(DEFAULT_CASES),
                        help=f"place:percent items, places {', '.join(PLACES)} (default {DEFAULT_CASES.replace('%', '%%')})")
    parser.add_argument("--fail-slower", type=percent_type("--fail-slower"), default=DEFAULT_THRESHOLD,
                        help=f"the gate's threshold (default {DEFAULT_THRESHOLD * 100:g}%%, the gate's own)")
    parser.add_argument("--also-judge-at", default=[], metavar="PERCENT,...",
                        type=lambda t: [percent_type("--also-judge-at")(x) for x in t.split(",")],
                        help="judge the same pairs at these thresholds too, e.g. 5%% (aimed rounds aim at --fail-slower)")
    parser.add_argument("--slowed-every", type=int, default=1, metavar="K",
                        help="slowed runs after every K-th unchanged run only (default 1: pairs slowed pairs per case; "
                             "K: about pairs / K), so that many unchanged pairs cost fewer runs")
    parser.add_argument("--rank-groups", type=int, default=None,
                        help="groups of ranks every run spreads its rounds over (default: the suite's)")
    parser.add_argument("--as-one-group", action="store_true",
                        help="with --rejudge: judge the pairs as the gate did before groups of ranks (each run's rounds "
                             "as one group, a slowdown called from them), for a before / after on the same runs")
    parser.add_argument("--aimed", action="store_true",
                        help="take every run after the first with --benchmark-compare, its rounds aimed at the decision")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="minimum rounds of every run (default: the suite's)")
    parser.add_argument("--max-rounds", type=int, default=None, help="default: the suite's (ddp.bench.config.parsing.MAX_ROUNDS)")
    parser.add_argument("--round-budget", type=float, default=None,
                        help="seconds of rounds per benchmark (default: the suite's share of its session budget)")
    parser.add_argument("--default-runs", action="store_true",
                        help="every run the default perf run (pytest perf_tests, every benchmark); the slowed runs slow "
                             "the registered strategy --slow by --slowdown after synchronizing (examples.slow_registered)")
    parser.add_argument("--slow", default="bucketed", help="with --default-runs: the registered strategy slowed")
    parser.add_argument("--slowdown", type=percent_type("--slowdown"), default=0.15,
                        help="with --default-runs: its wait, a share of its own median step (default 15%%)")
    parser.add_argument("--out", type=Path, default=Path("power-study"))
    parser.add_argument("--rejudge", type=Path, default=None, metavar="STUDY",
                        help="run nothing: judge the runs an earlier study saved in STUDY again, with the gate as it is "
                             "now, writing the report to --out (give the study's --models, --pairs and --cases)")
    args = parser.parse_args()
    if args.rejudge and not (args.rejudge / "pairs.json").is_file():
        raise SystemExit(f"--rejudge: {args.rejudge} holds no pairs.json: give the --out of an earlier study")
    args.earlier_pairs = json.loads((args.rejudge / "pairs.json").read_text()) if args.rejudge else []
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty: give a new --out (nothing saved is overwritten)")
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    if args.default_runs:
        print(write_default_report(args, default_runs(args, began), began, finished=True))
        return 0
    pairs = study(args, began)
    print(write_report(args, pairs, began, finished=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
