"""``python -m ddp memory``: will it fit? The predicted peak memory per rank of each configuration
given (the grid options of ``pytest perf_tests``), by category, whether it fits in the device's
memory, and the largest batch per rank that fits for each strategy (``ddp.bench.memory.predict``).
Nothing is built: the model is read on the meta device and its step traced on fake tensors, so
the xl model at any world size takes seconds on a CPU."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from ddp.analysis.tables import table
from ddp.bench.config.options import add_config_options, add_launch_options, config_values, option
from ddp.bench.config.step_config import AXES, expand
from ddp.bench.memory.predict import GIB, HEADROOM, NoPrediction, fits, host_memory_bytes, largest_batch, predict, usable_bytes
from ddp.cli import UsageError
from ddp.strategies.bucketed import DEFAULT_BUCKET_SIZE_MB
from ddp.strategies.registry import STRATEGIES

LISTS = tuple(name for name, axis in AXES.items() if not axis.one_per_grid)  # every axis a grid lists: all but the model
COLUMNS = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "communication")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    device = "gpu" if torch.cuda.is_available() else "cpu"
    defaults = {name: getattr(axis, device) for name, axis in AXES.items() if name in (*LISTS, "model")}
    defaults["strategy"] = tuple(STRATEGIES)
    defaults["model"] = defaults["model"][0]
    defaults["bucket_size_mb"] = (DEFAULT_BUCKET_SIZE_MB,)  # one cap: the cap changes no strategy's memory
    add_config_options(parser.add_argument, defaults, lists=LISTS)
    add_launch_options(parser.add_argument, only=("--world-size",))  # the ranks sharded state is split among
    option("--device-memory").bind(parser.add_argument, None, "this machine's GPU, else the host's available memory "
                                   "shared among the ranks")


def device_memory(args: argparse.Namespace) -> tuple[int, str]:
    if args.device_memory_bytes is not None:
        return args.device_memory_bytes, "given"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    return host_memory_bytes(args.world_size), f"this host's available memory shared by {args.world_size} ranks"


def main(args: argparse.Namespace) -> int:
    values = config_values(vars(args).get)
    try:
        configs = expand({name: value if name in LISTS else (value,) for name, value in values.items()})
    except ValueError as error:
        raise UsageError(str(error)) from None
    memory_bytes, source = device_memory(args)
    usable = usable_bytes(memory_bytes)
    try:
        predictions = {config: predict(config, args.world_size) for config in configs}
    except NoPrediction as error:
        raise UsageError(f"no prediction: {error}") from None
    unit, scale = ("GiB", GIB) if max(p.total_bytes for p in predictions.values()) >= GIB else ("MiB", 2**20)
    rows = []
    for config, prediction in predictions.items():
        categories = prediction.categories()
        rows.append([config.label, config.batch_size, config.seq_len, config.variant,
                     *(f"{categories[name] / scale:.2f}" for name in COLUMNS), f"{prediction.total_bytes / scale:.2f}",
                     prediction.moment, "yes" if fits(config, args.world_size, memory_bytes) else "NO"])
    print(f"model {args.model} on {args.world_size} ranks: predicted peak per rank, {unit} "
          f"(device memory {memory_bytes / GIB:.1f} GiB, {source}; {usable / GIB:.1f} GiB usable, {HEADROOM:.0%} kept "
          "for the allocator and kernels)")
    print(table(rows, ["strategy", "batch", "seq", "options", "params", "bufs", "grads", "optim", "activ", "temps",
                       "comm", "peak", "at", "fits"]))
    largest = {}
    for config in configs:
        key = dataclasses.replace(config, batch_size=1)
        if key not in largest:
            largest[key] = largest_batch(key, args.world_size, memory_bytes)
    print("\nlargest batch per rank that fits:")
    print(table([[c.label, c.seq_len, c.variant, b if b else "none (not even batch 1)"] for c, b in largest.items()],
                ["strategy", "seq", "options", "batch per rank"]))
    return 0
