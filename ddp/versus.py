"""``python -m ddp versus``: ``bucketed`` against PyTorch's DistributedDataParallel, side by side.

Both strategies (and ``local``, the floor with no communication) wrap the same model, built from
the same seed, with the same bucket size, on the same rank group, and train it on the same data
with AdamW. Every round runs one step of each, in an order that rotates from round to round, so
that drift in the machine (turbo, other processes, page cache) falls on all of them alike. A step
is forward, loss, backward, ``finish_gradient_synchronization()``, ``optimizer.step()`` and
``optimizer.zero_grad()``; the ranks meet at a barrier before it, and the round's figure is the
slowest rank's time, since the next step cannot start before that rank is done.

Reported: the median step time of each strategy, the ratio bucketed / torch (below 1 means
bucketed is faster), and each DDP's overhead over ``local``, the price of its communication.

The rank side keeps the built models between calls (``prepare``, ``run_round`` as often as
wanted, ``release``), so that pytest-benchmark can time the rounds one by one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import ddp
from ddp.launcher import RankGroup, rank_info
from ddp.model import MODEL_SIZES, build_model, language_model_loss, random_batch

STRATEGIES = ("local", "bucketed", "torch")


class DeepMLP(nn.Module):
    """``depth`` square Linear + ReLU layers: many mid-sized gradients, as in a deep network."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ConvNet(nn.Module):
    """A plain 3x3 convolution stack over a small image, then a linear classifier."""

    def __init__(self, channels: int, depth: int, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.body = nn.Sequential(
            *(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()) for _ in range(depth))
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(torch.relu(self.stem(x)))  # (B, C, H, W)
        return self.head(x.mean(dim=(2, 3)))  # (B, classes)


@dataclass(frozen=True)
class BenchModel:
    """A model to race on, with the batch one rank trains on per step and its loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    summary: str


def _lm_batch(size: str, batch_size: int, seq_len: int):
    return lambda generator: random_batch(MODEL_SIZES[size], batch_size, seq_len, generator=generator)


def _regression_batch(rows: int, features: int):
    return lambda generator: (torch.randn(rows, features, generator=generator), torch.randn(rows, features, generator=generator))


def _image_batch(images: int, side_pixels: int, classes: int = 1000):
    def batch(generator):
        x = torch.randn(images, 3, side_pixels, side_pixels, generator=generator)
        return x, torch.randint(0, classes, (images,), generator=generator)

    return batch


# Per-rank batches are small: on CPU the step is dominated by compute, and a small batch keeps the
# share of the step that communication can take (and the DDPs can differ in) visible.
BENCH_MODELS: dict[str, BenchModel] = {
    # 111 tensors, 128,625,408 parameters (~129M)
    "transformer-small": BenchModel(
        lambda: build_model("small", context_length=64), _lm_batch("small", 1, 64), language_model_loss,
        "Transformer LM 'small', 1 x 64 tokens per rank",
    ),
    # 48 tensors, 100,712,448 parameters (~101M): 24 x Linear(2048, 2048)
    "mlp": BenchModel(
        lambda: DeepMLP(2048, 24), _regression_batch(16, 2048), F.mse_loss,
        "deep MLP, 24 x Linear(2048, 2048), 16 rows per rank",
    ),
    # 8 tensors, 104,878,080 parameters (~105M): 4 x Linear(5120, 5120), each 100 MiB of gradient
    "wide-mlp": BenchModel(
        lambda: DeepMLP(5120, 4), _regression_batch(16, 5120), F.mse_loss,
        "wide MLP, 4 x Linear(5120, 5120), 16 rows per rank",
    ),
    # 44 tensors, 74,399,720 parameters (~74M): 20 x Conv2d(640, 640, 3)
    "conv": BenchModel(
        lambda: ConvNet(640, 20), _image_batch(2, 6), F.cross_entropy,
        "conv net, 20 x Conv2d(640, 640, 3x3), 2 images of 6 x 6 pixels per rank",
    ),
    # 21 tensors, 259,392 parameters: for tests and CI smoke runs
    "transformer-tiny": BenchModel(
        lambda: build_model("tiny"), _lm_batch("tiny", 2, 32), language_model_loss,
        "Transformer LM 'tiny', 2 x 32 tokens per rank",
    ),
}


@dataclass(frozen=True)
class VersusConfig:
    model: str = "transformer-small"
    """A name from BENCH_MODELS."""
    bucket_size_mb: float = 25.0
    """Bucket cap in MiB, given to bucketed and torch alike."""
    rounds: int = 10
    """Timed rounds; each runs one step of every strategy."""
    warmup_rounds: int = 2
    """Untimed rounds first: the first steps allocate gradients and optimizer state, and torch's
    reducer rebuilds its buckets after its first step."""
    seed: int = 0
    """Seed of the model's initial weights, the same for every strategy."""


@dataclass
class VersusResult:
    config: VersusConfig
    parameters: int
    world_size: int
    backend: str
    threads_per_rank: int
    step_seconds: dict[str, list[float]] = field(default_factory=dict)
    """Per strategy, each timed round's step time on its slowest rank."""

    def median_seconds(self, strategy: str) -> float:
        return statistics.median(self.step_seconds[strategy])

    @property
    def ratio(self) -> float:
        """Median bucketed step time over median torch step time: below 1 means bucketed is faster."""
        return self.median_seconds("bucketed") / self.median_seconds("torch")

    @property
    def paired_ratio(self) -> float:
        """Median over rounds of bucketed / torch within the round: steadier on a busy machine."""
        return statistics.median(b / t for b, t in zip(self.step_seconds["bucketed"], self.step_seconds["torch"]))

    def overhead_seconds(self, strategy: str) -> float:
        """Median step time over ``local``'s: what synchronizing gradients costs that strategy."""
        return self.median_seconds(strategy) - self.median_seconds("local")

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "median_step_seconds": {name: self.median_seconds(name) for name in self.step_seconds},
            "ratio_bucketed_over_torch": self.ratio,
            "paired_ratio_bucketed_over_torch": self.paired_ratio,
            "overhead_over_local_seconds": {name: self.overhead_seconds(name) for name in ("bucketed", "torch")},
        }


# ---------------------------------------------------------------- rank side

@dataclass
class _Contender:
    model: nn.Module
    optimizer: torch.optim.Optimizer


_contenders: dict[str, _Contender] = {}
_batches: list[tuple[torch.Tensor, torch.Tensor]] = []
_loss: Callable | None = None


def prepare(config: VersusConfig) -> dict:
    """Runs on every rank: build each strategy's model from the same seed, and a few batches."""
    global _loss
    info = rank_info()
    bench = BENCH_MODELS[config.model]
    release()
    for name in STRATEGIES:
        torch.manual_seed(config.seed)
        module = bench.build().to(info.device)
        options = {"bucket_size_mb": config.bucket_size_mb} if name in ddp.BUCKETED_STRATEGIES else {}
        model = ddp.make_ddp(name, module, **options)
        _contenders[name] = _Contender(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    # Each rank its own rows, the same for every strategy.
    generator = torch.Generator().manual_seed(1000 + info.rank)
    _batches.extend(tuple(t.to(info.device) for t in bench.batch(generator)) for _ in range(2))
    _loss = bench.loss
    module = _contenders["local"].model.module
    return {"parameters": sum(p.numel() for p in module.parameters() if p.requires_grad), "threads": torch.get_num_threads()}


def _step(contender: _Contender, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    _loss(contender.model(inputs), targets).backward()
    contender.model.finish_gradient_synchronization()
    contender.optimizer.step()
    contender.optimizer.zero_grad()


def _wait_for_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_round(round_index: int) -> dict[str, float]:
    """Runs on every rank: one step of each strategy; returns each one's seconds on this rank."""
    info = rank_info()
    inputs, targets = _batches[round_index % len(_batches)]
    shift = round_index % len(STRATEGIES)
    order = STRATEGIES[shift:] + STRATEGIES[:shift]
    seconds = {}
    for name in order:
        _wait_for_device(info.device)
        dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        _step(_contenders[name], inputs, targets)
        _wait_for_device(info.device)
        seconds[name] = time.perf_counter() - start
    return seconds


def check_same_parameters() -> None:
    """Runs on every rank: bucketed and torch took the same steps, so their weights must agree.

    The correctness check inside the performance run: a fast DDP that trains differently fails.
    """
    bucketed, reference = (_contenders[name].model.module for name in ("bucketed", "torch"))
    for (name, actual), expected in zip(bucketed.named_parameters(), reference.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"bucketed and torch differ at {name}: {m}")


def release() -> None:
    """Runs on every rank: drop the models, their optimizer state and the batches."""
    _contenders.clear()
    _batches.clear()


# ---------------------------------------------------------------- parent side

def slowest_rank(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The round's step time of each strategy: the slowest rank's, since the others wait for it."""
    return {name: max(rank[name] for rank in per_rank) for name in per_rank[0]}


class Race:
    """The parent's side of a race on a rank group: ``with Race(group, config) as race: race.round()``.

    Entering builds the models on the ranks and runs the warm-up rounds; ``round()`` runs and
    records one timed round; leaving checks that bucketed and torch still agree, then frees them.
    """

    def __init__(self, group: RankGroup, config: VersusConfig) -> None:
        if config.model not in BENCH_MODELS:
            raise ValueError(f"unknown model {config.model!r}: choose one of {', '.join(BENCH_MODELS)}")
        self.group = group
        self.config = config
        self._rounds_run = 0
        self.result: VersusResult | None = None

    def __enter__(self) -> Race:
        info = self.group.run(prepare, self.config)[0]
        self.result = VersusResult(self.config, info["parameters"], self.group.world_size, self.group.backend, info["threads"])
        self.result.step_seconds = {name: [] for name in STRATEGIES}
        for _ in range(self.config.warmup_rounds):
            self._run_round()
        return self

    def _run_round(self) -> dict[str, float]:
        seconds = slowest_rank(self.group.run(run_round, self._rounds_run))
        self._rounds_run += 1
        return seconds

    def round(self) -> None:
        for name, value in self._run_round().items():
            self.result.step_seconds[name].append(value)

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is None and self._rounds_run:
                self.group.run(check_same_parameters)
        finally:
            self.group.run(release)


def versus(group: RankGroup, config: VersusConfig) -> VersusResult:
    """Race the strategies on ``group``: ``config.rounds`` timed rounds after the warm-up ones."""
    with Race(group, config) as race:
        for _ in range(config.rounds):
            race.round()
    return race.result


def table(result: VersusResult) -> str:
    rows = []
    for name in STRATEGIES:
        overhead = "" if name == "local" else f"{result.overhead_seconds(name) * 1e3:.1f}"
        ratio = f"{result.ratio:.3f}" if name == "bucketed" else ""
        rows.append([name, f"{result.median_seconds(name) * 1e3:.1f}", overhead, ratio])
    return tabulate(
        rows, headers=["strategy", "median step ms", "overhead over local ms", "bucketed / torch"], disable_numparse=True
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=VersusConfig.model, choices=list(BENCH_MODELS), help="model to train (default: %(default)s)")
    parser.add_argument("--bucket-size-mb", type=float, default=VersusConfig.bucket_size_mb, help="bucket cap in MiB for both DDPs (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=VersusConfig.rounds, help="timed rounds, one step of each strategy per round (default: %(default)s)")
    parser.add_argument("--warmup-rounds", type=int, default=VersusConfig.warmup_rounds, help="untimed rounds first (default: %(default)s)")
    parser.add_argument("--world-size", type=int, default=2, help="number of ranks (default: %(default)s)")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"), help="auto = nccl with a GPU per rank, else gloo")
    parser.add_argument("--json", metavar="PATH", help="also write the result, every round included, as JSON")


def main(args: argparse.Namespace) -> int:
    config = VersusConfig(args.model, args.bucket_size_mb, args.rounds, args.warmup_rounds)
    with RankGroup(args.world_size, args.backend) as group:
        result = versus(group, config)
    print(
        f"{BENCH_MODELS[config.model].summary}: {result.parameters / 1e6:.1f}M parameters, "
        f"{result.world_size} ranks, {result.backend}, {result.threads_per_rank} threads per rank, "
        f"bucket {config.bucket_size_mb:g} MiB, median of {config.rounds} rounds"
    )
    print(table(result))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result.to_json(), file, indent=2)
    return 0
