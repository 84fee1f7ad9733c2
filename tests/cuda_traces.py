"""Hand-built step records and CUDA (Kineto) trace events, worked by hand: the inputs of the
tests of reading recorded steps, profiles and traces (``test_profile.py``, ``test_trace.py``)."""

from __future__ import annotations

from ddp.bench.collectives.timeline import read_recorded
from ddp.bench.config.shape import RecordedStep


def read_on_nccl(events: list[dict], steps: list[RecordedStep], plan: list[int] | None = None) -> list[RecordedStep]:
    """Recorded steps read from their CUDA trace as the suite's traced steps and ``ddp profile``
    read them on NCCL (``read_recorded``): GPU phases, NCCL's kernels or the records, the timeline."""
    return read_recorded(events, steps, plan, cuda=True, nccl=True, own_records=True)


def collective(launch: float, done: float, size_bytes: int = 4) -> dict:
    return {"label": "c", "size_bytes": size_bytes, "launch_seconds": launch, "done_seconds": done}


def hand_step(forward, backward, compute_end, sync, optimizer, collectives) -> RecordedStep:
    """A recorded step of the default shape, its phases and collectives given."""
    return RecordedStep({"forward": forward, "backward": backward, "gradient_sync": sync, "optimizer": optimizer},
                        compute_end, collectives)


# Real names from PyTorch CUDA traces (Kineto), long template arguments cut where marked "...".
NCCL_2_19_ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


NCCL_2_18_ALL_REDUCE = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"


ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>(...)"


COPY_KERNEL = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
               "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}...>(...)")


HOPPER_GEMM = ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32_warpgroupsize1x1x1"
               "_execute_segment_k_off_kernel")


AMPERE_GEMM = "ampere_sgemm_128x64_nn"


CUDNN = "void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)2>(...)"


FLASH = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, ...>(...)"


MEM_EFFICIENT = "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, ...>::Params)"


ADAM = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::...>(...)"


# A synthetic CUDA trace. CPU ranges in perf_counter seconds; the trace clock is 1000 µs ahead.
TRACE_OFFSET_US = 1000.0


# One profiled step's CPU ranges; collectives added per case.
FORWARD = [1.0, 2.0]


BACKWARD = [2.0, 3.0]


SYNC = [3.0, 3.5]


OPTIMIZER = [3.5, 4.0]


def cuda_trace(gpu_events) -> list[dict]:
    """Trace events for ``gpu_events``: (correlation, launch s, start s, end s, name, category) each,
    with a cudaLaunchKernel (or cudaMemcpyAsync) runtime event carrying the same correlation id."""

    def at(seconds):
        return seconds * 1e6 + TRACE_OFFSET_US

    events = [{"name": "forward", "cat": "user_annotation", "ph": "X", "ts": at(FORWARD[0]), "dur": 1e6}]
    for correlation, launch, start, end, name, category in gpu_events:
        launcher = "cudaMemcpyAsync" if category == "gpu_memcpy" else "cudaLaunchKernel"
        events.append({"cat": "cuda_runtime", "name": launcher, "ph": "X", "ts": at(launch), "dur": 5,
                       "args": {"correlation": correlation}})
        events.append({"cat": category, "name": name, "ph": "X", "ts": at(start), "dur": (end - start) * 1e6,
                       "args": {"correlation": correlation}})
    return events
