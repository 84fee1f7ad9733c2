"""Functions the tests run on a group of ranks (``RankGroup.run``) to see that it works."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp.launcher import Rank, on_rank


@on_rank
def sum_of_ranks(rank: Rank) -> float:
    # on the rank's device: a group initialized with NCCL maps only CUDA tensors
    tensor = torch.tensor([float(rank.info.rank)], device=rank.info.device)
    dist.all_reduce(tensor)
    return tensor.item()
