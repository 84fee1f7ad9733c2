"""A plain data-parallel training loop, written as a user writes one and started as a user starts
it, the reference the harness is held to (perf_tests/test_harness_cost.py):

    torchrun --nproc-per-node 2 perf_tests/plain_loop.py --model mini --batch-size 4 --seq-len 64

Nothing of ddp-bench's measurement runs in it: the model is ``ddp.model``'s LM (the same work the
harness's ``local`` trains), the step is forward, cross-entropy, backward, ``AdamW(foreach=True)``
and ``zero_grad``, each rank its own batch, no gradient communication (``local``'s work), timed
between an untimed barrier and, on CUDA, a synchronize; a round is its slowest rank's step.

It runs its steps in blocks when told, so that a test can interleave them with the harness's: with
``--store HOST:PORT`` every rank waits (blocked, idle) on that store's key ``go/K`` for the K-th
block's number of steps (0: stop), and rank 0 writes the block's round times under ``done/K``.
Without it, it runs ``--steps`` steps and prints them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's ddp, as the harness's

from ddp.model import MODEL_SIZES, build_model, random_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--store", default=None, help="HOST:PORT of a TCPStore to take blocks of steps from")
    args = parser.parse_args()

    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # this rank's share of the cores
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = build_model(args.model, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    generator = torch.Generator().manual_seed(1000 + rank)
    inputs, targets = (t.to(device) for t in random_batch(MODEL_SIZES[args.model], args.batch_size, args.seq_len,
                                                          generator=generator))

    def step() -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def rounds(steps: int) -> list[float]:
        mine = [step() for _ in range(steps)]
        every = [None] * world
        dist.all_gather_object(every, mine)
        return [max(times[index] for times in every) for index in range(steps)]

    for _ in range(args.warmup_steps):
        step()
    if args.store is None:
        result = rounds(args.steps)
        if rank == 0:
            print(json.dumps(result))
    else:
        host, port = args.store.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=600))
        block = 0
        while (steps := int(store.get(f"go/{block}"))) > 0:
            result = rounds(steps)
            if rank == 0:
                store.set(f"done/{block}", json.dumps(result))
            block += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
