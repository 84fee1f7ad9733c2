"""The cost model of ``python -m ddp simulate`` against values worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from ddp.simulate import (
    LINKS,
    Compute,
    Gradient,
    Link,
    bucket_launches,
    channel_end,
    fit_link,
    gradients_in_backward_order,
    load_run,
    predict_step,
    ready_times,
    validation_rows,
    predict_grid,
)

MB = 2**20


def test_ring_allreduce_time() -> None:
    link = Link("test", latency_seconds=1e-5, busbw_bytes_per_second=1e9)
    # 8 ranks: 14 steps of 10 us, and 100 MB x 2 x 7/8 = 175 MB at 1 GB/s.
    assert link.allreduce_seconds(100e6, 8) == pytest.approx(14 * 1e-5 + 0.175)
    # 2 ranks move the buffer once: 2 steps, 100 MB at 1 GB/s.
    assert link.allreduce_seconds(100e6, 2) == pytest.approx(2e-5 + 0.1)
    assert link.allreduce_seconds(100e6, 1) == 0.0


def test_tree_changes_only_the_latency_term() -> None:
    ring = Link("r", 1e-5, 1e9, "ring")
    tree = Link("t", 1e-5, 1e9, "tree")
    # 1024 ranks: ring 2046 steps, tree 2 x 10.
    assert ring.allreduce_seconds(0, 1024) == pytest.approx(2046e-5)
    assert tree.allreduce_seconds(0, 1024) == pytest.approx(20e-5)
    bandwidth = 1e6 * 2 * 1023 / 1024 / 1e9
    assert tree.allreduce_seconds(1e6, 1024) - tree.allreduce_seconds(0, 1024) == pytest.approx(bandwidth)


def test_fit_recovers_known_alpha_and_busbw() -> None:
    truth = Link("truth", latency_seconds=25e-6, busbw_bytes_per_second=3e9)
    samples = [(size, n, truth.allreduce_seconds(size, n)) for n in (2, 4, 6) for size in (10_000, MB, 10 * MB, 100 * MB)]
    fitted = fit_link(samples)
    assert fitted.latency_seconds == pytest.approx(25e-6, rel=1e-6)
    assert fitted.busbw_bytes_per_second == pytest.approx(3e9, rel=1e-6)


def test_fit_at_one_world_size_with_noise() -> None:
    truth = Link("truth", latency_seconds=50e-6, busbw_bytes_per_second=2e9)
    noise = [1.02, 0.98, 1.01, 0.99]
    samples = [(s, 2, truth.allreduce_seconds(s, 2) * k) for s, k in zip((MB // 10, MB, 10 * MB, 100 * MB), noise)]
    fitted = fit_link(samples)
    assert fitted.busbw_bytes_per_second == pytest.approx(2e9, rel=0.03)


def test_fit_refuses_a_single_size() -> None:
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([(MB, 2, 1e-3), (MB, 2, 1.1e-3)])


def test_channel_serializes_transfers() -> None:
    # Ready at 0, 1, 5 with durations 2, 2, 1: the second waits for the first (ends 4), the third
    # starts when ready (5) and ends at 6.
    assert channel_end([(0.0, 2.0), (1.0, 2.0), (5.0, 1.0)]) == pytest.approx(6.0)


def test_ready_times_follow_backward_flops() -> None:
    gradients = [Gradient("a", 4, 1.0), Gradient("b", 4, 0.0), Gradient("c", 4, 3.0)]
    assert ready_times(gradients, backward_seconds=8.0) == pytest.approx([2.0, 2.0, 8.0])


def test_bucket_schedule_exposed_time_by_hand() -> None:
    # Three gradients of 1 MB, 1 MB, 2 MB produced at 1/4, 2/4, 4/4 of a 4 s backward. A link of
    # 1 MB/s on 2 ranks (no latency) takes 1 s per MB (plus the bucket's 4-byte flags).
    gradients = [Gradient("a", MB, 1.0), Gradient("b", MB, 1.0), Gradient("c", 2 * MB, 2.0)]
    link = Link("slow", latency_seconds=0.0, busbw_bytes_per_second=MB)
    compute = Compute(step_seconds=6.0)  # backward = 2/3 x 6 = 4 s: gradients ready at 1, 2, 4 s
    flag_seconds = 4 / MB
    # Buckets of 2 MB: [a, b] ready at 2 s, 2 s long -> ends at 4 s (+ 2 flags); [c] starts after
    # it and ends at 6 s (+ all 3 flags): 2 s exposed after backward.
    launches = bucket_launches(gradients, ready_times(gradients, 4.0), 2.0, link, 2)
    assert [r for r, _ in launches] == pytest.approx([2.0, 4.0])
    step, exposed, comm, calls = predict_step("bucketed", 2.0, compute, gradients, link, 2)
    assert calls == 2
    assert exposed == pytest.approx(2.0 + 3 * flag_seconds)
    assert step == pytest.approx(6.0 + exposed)
    assert comm == pytest.approx(4.0 + 3 * flag_seconds)
    # One gradient at a time: a 1-2 s, b 2-3 s, c 4-6 s: also 2 s after backward.
    assert predict_step("overlap", None, compute, gradients, link, 2)[1] == pytest.approx(2.0)
    # After backward: naive and flat expose all 4 s.
    assert predict_step("naive", None, compute, gradients, link, 2)[1] == pytest.approx(4.0)
    assert predict_step("flat", None, compute, gradients, link, 2)[1] == pytest.approx(4.0)
    # On CPU, communication hidden under backward still costs its time.
    hidden = comm - exposed
    assert predict_step("bucketed", 2.0, compute, gradients, link, 2, overlap_slowdown=1.0)[0] == pytest.approx(
        6.0 + exposed + hidden
    )


def test_buckets_follow_plan_buckets() -> None:
    gradients = gradients_in_backward_order("tiny", seq_len=32)
    link = LINKS["ib-400g"]
    ready = ready_times(gradients, 1.0)
    # tiny: 259,392 parameters, 1 MB of float32 gradients: one bucket at 1 MB, nine at 0.1 MB
    # (ddp/bucketed.py reports the same counts).
    assert len(bucket_launches(gradients, ready, 1.0, link, 2)) == 1
    assert len(bucket_launches(gradients, ready, 0.1, link, 2)) == 9
    assert sum(g.size_bytes for g in gradients) == 259_392 * 4
    assert gradients[0].name == "lm_head.weight" and gradients[-1].name == "token_embedding.weight"


def test_no_communication_on_one_rank_or_for_local() -> None:
    gradients = gradients_in_backward_order("tiny", seq_len=32)
    for strategy, bucket in (("naive", None), ("bucketed", 1.0), ("local", None)):
        step, exposed, _, _ = predict_step(strategy, bucket, Compute(0.1), gradients, LINKS["ib-400g"], 1)
        assert (step, exposed) == (0.1, 0.0)


def test_validation_reads_a_saved_run(tmp_path) -> None:
    def step(strategy, bucket, median, comm_wait):
        extra = {"strategy": strategy, "backend": "nccl", "device": "NVIDIA H100", "world_size": 2, "model_size": "tiny",
                 "batch_size": 2, "seq_len": 32, "bucket_size_mb": bucket, "comm_wait_seconds": comm_wait}  # fmt: skip
        return {"name": strategy, "extra_info": extra, "stats": {"median": median}}

    run = {"benchmarks": [step("local", None, 0.010, 0.0), step("flat", None, 0.012, 0.002)]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    loaded = load_run(path)
    link = Link("l", 0.0, 1e9)
    computes = {(2, 32): Compute(0.010)}
    predictions = predict_grid("tiny", computes, [("local", None), ("flat", None)], [2], link, 0.0)
    rows = validation_rows(loaded, predictions)
    flat = next(r for r in rows if r["strategy"] == "flat")
    # tiny's 1,037,568 gradient bytes at 1 GB/s on 2 ranks: 1.04 ms after a 10 ms step.
    assert flat["predicted_step_seconds"] == pytest.approx(0.010 + 259_392 * 4 / 1e9)
    assert flat["error"] == pytest.approx(flat["predicted_step_seconds"] / 0.012 - 1)
    assert math.isclose(next(r for r in rows if r["strategy"] == "local")["error"], 0.0, abs_tol=1e-12)
