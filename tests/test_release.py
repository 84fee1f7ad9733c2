"""Every configuration gets the memory it would get alone: once the harness releases a
configuration, nothing it allocated is alive on the rank.

Checked on the ranks with Python's own bookkeeping: weak references to the trainer, the strategy,
the wrapped module, every parameter, gradient and optimizer state, and every other tensor that
appeared while the configuration was built and stepped (buckets, masks, flat buffers, a user's own
state), all dead after ``release``; and across a grid of configurations, the tensors alive on the
rank are exactly those alive before the first. A strategy that keeps a hook on a parameter which
refers back to itself (``bucketed``, ``overlap`` and any user's class that registers hooks) is a
cycle through autograd that the collector cannot free: this is what kept xl alive between
configurations (measured on CPU on 2026-11-23: one to three fp32 copies of xl per earlier one). On CUDA,
``memory_allocated`` must also be back where it was.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh

from ddp.bench.config.step_config import StepConfig
from ddp.bench.rounds.rank_state import RankBench, prepare, release, timed_round
from ddp.launcher import Rank, RankInfo, on_rank
from ddp.strategies import STRATEGIES, DataParallel, takes_bucket_size


class SelfHookedDDP(DataParallel):
    """A user's DDP as many write it: a hook per parameter, bound to the strategy, never removed
    (no ``close``), all-reducing each gradient when it is accumulated."""

    def __init__(self, module, **options) -> None:
        super().__init__(module, **options)
        self.pending = []
        for param in self.parameters_to_sync:
            param.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, param) -> None:
        self.pending.append(torch.distributed.all_reduce(param.grad, op=torch.distributed.ReduceOp.AVG, async_op=True))

    def finish_gradient_synchronization(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []


def _live_tensors() -> dict[int, torch.Tensor]:
    """Every tensor alive on this rank, but PyTorch's own bookkeeping that outlives a configuration
    in its process-wide caches: the compiler's fake tensors (shapes and dtypes, no storage of their
    own) and the constants they stand for, and a DeviceMesh's rank layout (torch 2.11 keeps the
    sharding decisions of every DeviceMesh it saw, the 8-byte rank tensor with them, where none of
    its cache-clearing functions reaches; 2.13 does not)."""
    gc.collect()
    objects = gc.get_objects()
    fakes = [obj for obj in objects if isinstance(obj, FakeTensor)]
    bookkeeping = {id(fake) for fake in fakes}
    bookkeeping |= {id(fake.constant) for fake in fakes if getattr(fake, "constant", None) is not None}
    bookkeeping |= {id(value) for mesh in objects if isinstance(mesh, DeviceMesh) for value in vars(mesh).values()
                    if isinstance(value, torch.Tensor)}
    return {id(obj): obj for obj in objects if isinstance(obj, torch.Tensor) and id(obj) not in bookkeeping}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _describe(ref) -> str:
    obj = ref()
    if isinstance(obj, torch.Tensor):
        return f"tensor {tuple(obj.shape)} {obj.dtype}"
    return type(obj).__name__


def _references(trainer, before: dict[int, torch.Tensor]) -> dict[str, weakref.ref]:
    """Weak references to what ``trainer`` built, by name (a function of its own, so that no local
    variable of the caller keeps one of them alive)."""
    refs = {
        "trainer": weakref.ref(trainer),
        "strategy": weakref.ref(trainer.model),
        "module": weakref.ref(trainer.model.module),
    }
    for name, param in trainer.model.module.named_parameters():
        refs[f"parameter {name}"] = weakref.ref(param)
        if param.grad is not None:
            refs[f"gradient of {name}"] = weakref.ref(param.grad)
    for index, state in enumerate(trainer.optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                refs[f"optimizer state {key} of parameter {index}"] = weakref.ref(value)
    refs.update((f"tensor {key}", weakref.ref(t)) for key, t in _live_tensors().items() if key not in before)
    return refs


@on_rank
def build_step_release(rank: Rank, config: StepConfig) -> list[str]:
    """Runs on every rank: build and step ``config``, release it; what is still alive afterwards."""
    release(rank)
    before = _live_tensors()
    cuda = rank.info.device.type == "cuda"
    allocated_before = torch.cuda.memory_allocated() if cuda else None
    assert isinstance(prepare(rank, [config], 1), list)
    assert isinstance(timed_round(rank, [config], 0), list)
    refs = _references(rank.keep(RankBench).trainer(config), before)
    release(rank)
    gc.collect()
    alive = [f"{name}: {_describe(ref)}" for name, ref in refs.items() if ref() is not None]
    if cuda and torch.cuda.memory_allocated() > allocated_before:
        alive.append(f"CUDA memory: {torch.cuda.memory_allocated() - allocated_before} bytes more than before the build")
    return alive


def live_tensor_bytes() -> int:
    """Runs on every rank: bytes of the distinct storages of every tensor alive on this rank."""
    return _storage_bytes(_live_tensors().values())


def _configs(model: str, batch_size: int, seq_len: int) -> list[StepConfig]:
    names = [*STRATEGIES, f"{__name__}:SelfHookedDDP"]
    return [StepConfig(name, model, batch_size, seq_len, 1.0 if takes_bucket_size(name) else None) for name in names]


@pytest.mark.parametrize("config", [*_configs("tiny", 2, 16), StepConfig("bucketed", "tiny", 2, 16, 1.0, compile="on")],
                         ids=lambda c: c.test_id.split("-b2")[0].rsplit(":", 1)[-1] + ("-compile" if c.compile == "on" else ""))
def test_a_released_configuration_leaves_nothing_alive(rank_group, config) -> None:
    for rank, alive in enumerate(rank_group.run(build_step_release, config)):
        assert not alive, f"rank {rank} still holds, after release: {'; '.join(alive[:8])}"


@pytest.mark.slow
def test_memory_does_not_grow_across_a_grid_of_configurations(rank_group) -> None:
    rank_group.run(release)
    before = rank_group.run(live_tensor_bytes)
    for seq_len in (16, 32):
        for config in _configs("tiny", 2, seq_len):
            assert isinstance(rank_group.run(prepare, [config], 1)[0], list)
    rank_group.run(release)
    assert rank_group.run(live_tensor_bytes) == before


class _CudaAllocator:
    """The CUDA calls ``RankBench.release`` makes, on a machine without a GPU: a caching allocator
    holding, beside what configurations allocate, cuBLAS's workspace once a matmul has run, which
    ``torch.cuda.empty_cache`` leaves and ``torch._C._cuda_clearCublasWorkspaces`` frees."""

    CUBLAS_WORKSPACE_BYTES = 32 * 2**20

    def __init__(self) -> None:
        self.workspace_bytes = 0

    def matmul(self) -> None:
        self.workspace_bytes = self.CUBLAS_WORKSPACE_BYTES

    def clear_cublas_workspaces(self) -> None:
        self.workspace_bytes = 0

    def memory_allocated(self, device=None) -> int:
        return self.workspace_bytes


def test_cublas_workspaces_are_freed_on_release_and_not_reported_as_held(monkeypatch, capsys) -> None:
    allocator = _CudaAllocator()
    monkeypatch.setattr(torch.cuda, "memory_allocated", allocator.memory_allocated)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", allocator.clear_cublas_workspaces, raising=False)
    bench, rank = RankBench(), RankInfo(0, 2, "nccl", torch.device("cuda", 0))
    bench.release(rank)  # before anything was built: the level it returns to
    allocator.matmul()  # a configuration trained: cuBLAS made its workspace
    bench.release(rank)
    assert allocator.workspace_bytes == 0
    assert "still holds" not in capsys.readouterr().out
