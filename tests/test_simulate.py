"""The cost model of ``python -m ddp simulate`` (``ddp.analysis.costmodel``) against values worked out
by hand, and the command's errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from ddp.analysis.costmodel import (
    LINKS,
    Compute,
    Gradient,
    Link,
    Machine,
    NotModelled,
    Overheads,
    Sent,
    calibrate,
    calibrate_on_measured,
    channel_end,
    expected_max_of_normals,
    fit_link,
    gradients_by_flops,
    gradients_in_backward_order,
    gradients_of_module,
    module_of,
    parse_link,
    predict_grid,
    predict_step,
    ready_times,
    strategy_launches,
    validation_rows,
)
from ddp.bench.config.shape import StepShape
from ddp.bench.results.records import PredictionRecord, RunFileError, ValidationRecord, load_records, load_run
from ddp.cli import main as ddp_main
from ddp.strategies.bucketed import buffer_bytes, plan_buckets
from tests import synthetic

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
    # Buckets of 2 MB: [a, b] would be ready at 2 s; bucketed's first bucket holds 1 MiB at most
    # (FIRST_BUCKET_MB, as PyTorch's reducer plans it), so [a] goes at 1 s, 1 s long -> ends at
    # 2 s (+ its flag); [b] at 2 s after it -> 3 s (+ 2 flags); [c] at 4 s -> 6 s (+ 3 flags): 2 s
    # exposed after backward, and the flags of the three.
    sizes, kinds = [g.size_bytes for g in gradients], [g.element_size for g in gradients]
    assert plan_buckets(sizes, kinds, 2.0) == [[0, 1], [2]]
    assert plan_buckets(sizes, kinds, 2.0, first_bucket_mb=1.0) == [[0], [1], [2]]
    launches = strategy_launches("bucketed", gradients, ready_times(gradients, 4.0), 0.0, 2.0, link, 2)
    assert [r for r, _ in launches] == pytest.approx([1.0, 2.0, 4.0])
    assert [d for _, d in launches] == pytest.approx([1.0 + flag_seconds, 1.0 + flag_seconds, 2.0 + flag_seconds])
    step, exposed, comm, calls = predict_step("bucketed", 2.0, compute, gradients, link, 2)[:4]
    assert calls == 3
    assert exposed == pytest.approx(2.0 + flag_seconds)
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
    sizes, kinds = [g.size_bytes for g in gradients], [g.element_size for g in gradients]
    # tiny: 259,392 parameters, 1 MB of float32 gradients: one bucket at 1 MB, nine at 0.1 MB
    # (ddp/strategies/bucketed.py reports the same counts).
    assert len(strategy_launches("bucketed", gradients, ready, 0.0, 1.0, link, 2)) == len(plan_buckets(sizes, kinds, 1.0)) == 1
    assert len(plan_buckets(sizes, kinds, 0.1)) == 9
    assert sum(g.size_bytes for g in gradients) == 259_392 * 4
    assert gradients[0].name == "lm_head.weight" and gradients[-1].name == "token_embedding.weight"
    # Each launch is its plan bucket: ready when its last gradient is, all-reducing its gradients
    # and one flag element per tensor.
    expected = [
        (max(ready[i] for i in bucket), link.allreduce_seconds(sum(sizes[i] for i in bucket) + 4 * len(bucket), 2))
        for bucket in plan_buckets(sizes, kinds, 0.1)
    ]
    launches = strategy_launches("bucketed", gradients, ready, 0.0, 0.1, link, 2)
    assert [x for launch in launches for x in launch] == pytest.approx([x for launch in expected for x in launch])


def test_buckets_never_mix_element_sizes() -> None:
    # 100 B float32, 100 B bfloat16, 100 B float32 under a 1 MiB cap: three buckets, each
    # all-reducing its gradient bytes plus one flag element of its own element size.
    gradients = [Gradient("a", 100, 1.0, 4), Gradient("b", 100, 1.0, 2), Gradient("c", 100, 1.0, 4)]
    assert plan_buckets([100, 100, 100], [4, 2, 4], 1.0) == [[0], [1], [2]]
    assert [buffer_bytes(100, 1, 4), buffer_bytes(100, 1, 2)] == [104, 102]
    link = Link("byte per second", latency_seconds=0.0, busbw_bytes_per_second=1.0)
    # 2 ranks: t = bytes x 2 x 1/2 / busbw = bytes seconds
    launches = strategy_launches("bucketed", gradients, [1.0, 2.0, 3.0], 0.0, 1.0, link, 2)
    assert [x for launch in launches for x in launch] == pytest.approx([1.0, 104.0, 2.0, 102.0, 3.0, 104.0])


def test_no_communication_on_one_rank_or_for_local() -> None:
    gradients = gradients_in_backward_order("tiny", seq_len=32)
    for strategy, bucket in (("naive", None), ("bucketed", 1.0), ("local", None)):
        step, exposed = predict_step(strategy, bucket, Compute(0.1), gradients, LINKS["ib-400g"], 1)[:2]
        assert (step, exposed) == (0.1, 0.0)


def step_bench(strategy, bucket, rounds, comm_wait, batch_size=2, **values):
    """A step benchmark of a two-rank nccl run of the tiny model at ``batch_size`` (2), seq len 32."""
    record = synthetic.step(synthetic.config(strategy, bucket_size_mb=bucket, batch_size=batch_size, **values), rounds,
                            exposed=comm_wait, backend="nccl", device="NVIDIA H100", num_parameters=259_392)
    return synthetic.step_benchmark(record)


def allreduce_bench(size_bytes, seconds):
    return synthetic.allreduce_benchmark(2, size_bytes / MB, seconds, backend="nccl")


def write_run(path, benchmarks):
    return synthetic.write(path, synthetic.run_json(benchmarks, backend="nccl", device="cuda"))


def test_validation_reads_a_saved_run(tmp_path) -> None:
    path = write_run(
        tmp_path / "run.json",
        [step_bench("local", None, [0.010] * 3, 0.0), step_bench("flat", None, [0.012, 0.011, 0.013], 0.002)],
    )
    calibration = calibrate(load_run(path))
    assert (calibration.model, calibration.world_size, calibration.backend) == ("tiny", 2, "nccl")
    assert calibration.local_seconds == {(2, 32): pytest.approx(0.010)}
    link = Link("l", 0.0, 1e9)
    computes = {shape: Compute(seconds) for shape, seconds in calibration.local_seconds.items()}
    predictions = predict_grid("tiny", computes, [("local", None), ("flat", None)], [2], link, 0.0)
    rows = validation_rows(calibration, predictions)
    flat = next(r for r in rows if r.strategy == "flat")
    # tiny's 1,037,568 gradient bytes at 1 GB/s on 2 ranks: 1.04 ms after a 10 ms step.
    assert flat.predicted_step_seconds == pytest.approx(0.010 + 259_392 * 4 / 1e9)
    assert flat.measured_step_seconds == pytest.approx(0.012)  # the median of 12, 11, 13 ms
    assert flat.error == pytest.approx(flat.predicted_step_seconds / 0.012 - 1)
    assert math.isclose(next(r for r in rows if r.strategy == "local").error, 0.0, abs_tol=1e-12)
    # --statistic min: flat is measured by its fastest round, 11 ms
    fastest = next(r for r in validation_rows(calibrate(load_run(path), "min"), predictions) if r.strategy == "flat")
    assert fastest.measured_step_seconds == pytest.approx(0.011)


def _simulate_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        ddp_main(["simulate", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddp-bench simulate: error: "), err
    return err


def test_command_line_refuses_a_missing_run(tmp_path, capsys) -> None:
    err = _simulate_error(capsys, ["--from", str(tmp_path / "missing.json")])
    assert "missing.json: no such file" in err


def test_command_line_refuses_to_fit_a_link_on_one_all_reduce_size(tmp_path, capsys) -> None:
    # two all-reduce timings, both of 1 MiB: one size cannot tell latency from bandwidth
    path = write_run(
        tmp_path / "one_size.json",
        [step_bench("local", None, [0.010] * 3, 0.0), step_bench("flat", None, [0.012] * 3, 0.002),
         allreduce_bench(MB, 1e-3), allreduce_bench(MB, 1.1e-3)],
    )  # fmt: skip
    err = _simulate_error(capsys, ["--from", str(path)])
    assert "one_size.json: fitting a link needs all-reduce timings at two sizes or more" in err
    assert "or give --link" in err


def test_command_line_predicts_from_a_saved_run(tmp_path, capsys) -> None:
    # a link of 10 us and 1 GB/s: 1 MiB in 2 x 10 us + 1.049 ms, 10 MiB in 20 us + 10.49 ms on 2 ranks
    link = Link("truth", 10e-6, 1e9)
    flat_comm = 20e-6 + 259_392 * 4 / 1e9  # flat's one buffer of tiny's 1,037,568 gradient bytes
    # flat costs 2 ms besides its bytes at batch 2 and 4 ms at batch 4: the fixed step is their mean,
    # 3 ms, and each row is validated with the other row's
    path = write_run(
        tmp_path / "run.json",
        [step_bench("local", None, [0.010] * 3, 0.0), step_bench("flat", None, [0.010 + flat_comm + 0.002] * 3, 0.002),
         step_bench("local", None, [0.020] * 3, 0.0, batch_size=4),
         step_bench("flat", None, [0.020 + flat_comm + 0.004] * 3, 0.002, batch_size=4),
         allreduce_bench(MB, link.allreduce_seconds(MB, 2)), allreduce_bench(10 * MB, link.allreduce_seconds(10 * MB, 2))],
    )  # fmt: skip
    predictions, validation = tmp_path / "predictions.json", tmp_path / "validation.json"
    argv = ["simulate", "--from", str(path), "--world-sizes", "2,8", "--rank-variation", "0", "--algorithm", "ring",
            "--json", str(predictions), "--validation-json", str(validation)]
    assert ddp_main(argv) == 0
    out = capsys.readouterr().out
    assert "busbw 1.000 GB/s" in out and "  flat 3.00 [2.00, 4.00]" in out
    assert "fixed cost per collective: none beyond the link fitted on run.json's all-reduces" in out
    rows = {(r.strategy, r.batch_size): r for r in load_records(validation, ValidationRecord)}
    assert rows["flat", 2].predicted_step_seconds == pytest.approx(0.010 + flat_comm + 0.004)
    assert rows["flat", 4].predicted_step_seconds == pytest.approx(0.020 + flat_comm + 0.002)
    assert {r.fixed_step_from for r in rows.values()} == {"other shapes", "none"}
    predicted = {(p.strategy, p.batch_size, p.world_size): p for p in load_records(predictions, PredictionRecord)}
    assert set(predicted) == {(s, b, n) for s in ("local", "flat") for b in (2, 4) for n in (2, 8)}
    assert predicted["flat", 2, 8].fixed_step_seconds == pytest.approx(0.003)
    assert predicted["flat", 2, 8].step_seconds == pytest.approx(0.010 + 0.003 + link.allreduce_seconds(259_392 * 4, 8))


def test_a_run_measured_at_one_shape_is_validated_on_the_row_it_was_fitted_on_saying_so(tmp_path) -> None:
    path = write_run(tmp_path / "run.json", [step_bench("local", None, [0.010] * 3, 0.0),
                                             step_bench("flat", None, [0.013] * 3, 0.002),
                                             allreduce_bench(MB, 1e-3), allreduce_bench(10 * MB, 1e-2)])
    validation = tmp_path / "validation.json"
    assert ddp_main(["simulate", "--from", str(path), "--validation-json", str(validation)]) == 0
    flat = next(r for r in load_records(validation, ValidationRecord) if r.strategy == "flat")
    assert flat.fixed_step_from == "this row" and flat.error == pytest.approx(0.0, abs=1e-9)


def test_a_run_that_all_reduces_bf16_gradients_is_predicted_with_half_the_bytes(tmp_path) -> None:
    def run(grad_comm):
        return calibrate(load_run(write_run(tmp_path / f"{grad_comm}.json", [
            step_bench("local", None, [0.010] * 3, 0.0),
            step_bench("torch", 25.0, [0.012] * 3, 0.001, grad_comm=grad_comm)])))

    fp32, bf16 = run("fp32"), run("bf16")
    assert (fp32.sent, bf16.sent) == (Sent("fp32", "fp32"), Sent("fp32", "bf16"))
    link, computes = Link("l", 0.0, 1e9), fp32.computes()
    comm = {r.sent.grad_comm: predict_grid("tiny", computes, [("torch", 25.0)], [2], link, 0.0, sent=r.sent)[0].comm_seconds
            for r in (fp32, bf16)}
    assert comm["bf16"] == pytest.approx(comm["fp32"] / 2)


def test_what_a_run_measured_is_not_described_again_by_hand(tmp_path, capsys) -> None:
    path = write_run(tmp_path / "run.json", [step_bench("local", None, [0.010] * 3, 0.0)])
    err = _simulate_error(capsys, ["--from", str(path), "--precision", "bf16"])
    assert "--precision describe a configuration by hand" in err


def test_predictions_of_another_schema_are_refused_saying_so(tmp_path) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps([{"strategy": "naive", "bucket_size_mb": None, "batch_size": 2, "seq_len": 32, "world_size": 8,
                                 "step_seconds": 0.3, "exposed_comm_seconds": 0.1, "schema_version": 2}]))
    with pytest.raises(RunFileError, match=r"saved in ddp-bench's schema 2, this ddp-bench reads schema \d+: write it again"):
        load_records(path, PredictionRecord)


def test_a_reduce_scatter_and_an_all_gather_cost_one_all_reduce() -> None:
    # a sharded strategy's schedule: a ring all-reduce is a reduce-scatter then an all-gather
    link, n, size = Link("l", 5e-6, 1e9), 8, 64 * MB
    halves = [link.collective_seconds(c, size, n) for c in ("reduce_scatter", "all_gather")]
    assert halves[0] == halves[1] == pytest.approx(5e-6 * (n - 1) + size * (n - 1) / n / 1e9)
    assert sum(halves) == pytest.approx(link.collective_seconds("all_reduce", size, n))
    with pytest.raises(ValueError, match="no cost of collective 'broadcast'"):
        link.collective_seconds("broadcast", size, n)


# --- sharded strategies in the cost model -----------------------------------------------------


def test_sharded_strategies_move_the_bytes_their_collectives_need():
    """Full sharding puts 3 x (n-1)/n x the gradient bytes on the wire (two all-gathers and a
    reduce-scatter per unit), 1.5 times an all-reduce's 2 x (n-1)/n; ZeRO-1 adds one all-gather of
    the parameters, exposed, to bucketed's step."""
    link = Link("bandwidth only", latency_seconds=0.0, busbw_bytes_per_second=1e9)
    gradients = gradients_in_backward_order("tiny", 32)
    module = module_of("tiny")
    total_bytes = sum(g.size_bytes for g in gradients)
    compute = Compute(1.0)
    for world_size in (2, 8, 64):
        share = (world_size - 1) / world_size
        fsdp_comm = predict_step("fsdp", None, compute, gradients, link, world_size, module=module).comm_seconds
        assert fsdp_comm == pytest.approx(3 * share * total_bytes / 1e9)
        bucketed = predict_step("bucketed", 1.0, compute, gradients, link, world_size)
        zero1 = predict_step("sharded_optimizer", 1.0, compute, gradients, link, world_size)
        assert zero1[0] - bucketed[0] == pytest.approx(share * total_bytes / 1e9)
        prefetched = predict_step("torch_fsdp", None, compute, gradients, link, world_size, module=module)
        assert prefetched[0] <= predict_step("fsdp", None, compute, gradients, link, world_size, module=module)[0]


def test_full_sharding_is_modelled_on_the_units_the_strategy_gathers():
    """The units come from the strategy's own declaration (``Traits.units``), not from a naming
    convention: a model whose blocks are ``layers.<i>`` is three units and a root here, as ``fsdp``
    shards it; a strategy that shards parameters and names no units is not modelled."""
    module = torch.nn.Sequential()
    module.stem = torch.nn.Linear(8, 8)
    module.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    gradients = gradients_of_module(module, 1)
    link = Link("bandwidth only", latency_seconds=0.0, busbw_bytes_per_second=1e9)
    step, exposed, comm, calls = predict_step("fsdp", None, Compute(1.0), gradients, link, 2, module=module)[:4]
    assert calls == 3 * (3 + 1)  # two all-gathers and a reduce-scatter per unit: three layers and the root
    assert comm == pytest.approx(3 * 0.5 * sum(g.size_bytes for g in gradients) / 1e9)
    with pytest.raises(NotModelled, match="says no units"):
        predict_step("fsdp", None, Compute(1.0), gradients, link, 2)


def test_sharded_strategies_cost_nothing_on_one_rank():
    gradients = gradients_in_backward_order("tiny", 32)
    for strategy in ("sharded_optimizer", "zero", "fsdp", "torch_fsdp"):
        bucket = 1.0 if strategy in ("sharded_optimizer", "zero") else None
        assert predict_step(strategy, bucket, Compute(0.5), gradients, LINKS["ib-400g"], 1, module=module_of("tiny"))[:3] \
            == (0.5, 0.0, 0.0)


# --- a machine as it is built: nodes, two fabrics, NCCL's ring and tree -----------------------


def test_a_ring_across_nodes_pays_the_inter_node_latency_on_its_crossing_steps() -> None:
    """16 ranks on 2 nodes of 8: an all-reduce's ring crosses nodes on 2 of its 30 steps, moves
    2 x 15/16 of the buffer at the slower fabric; a reduce-scatter half of each."""
    intra, inter = Link("nv", 1e-6, 100e9), Link("ib", 10e-6, 40e9)
    machine = Machine(intra, inter, gpus_per_node=8, algorithm="ring")
    size = 64 * MB
    assert machine.collective_seconds("all_reduce", size, 16) == pytest.approx(28e-6 + 2 * 10e-6 + size * 30 / 16 / 40e9)
    assert machine.collective_seconds("reduce_scatter", size, 16) == pytest.approx(14e-6 + 10e-6 + size * 15 / 16 / 40e9)
    # inside one node: only the intra-node fabric
    assert machine.collective_seconds("all_reduce", size, 8) == pytest.approx(14e-6 + size * 14 / 8 / 100e9)
    # one NIC per GPU: a node moves 8 of them across nodes, and NVLink becomes the slower fabric
    per_gpu = Machine(intra, Link("ib", 10e-6, 40e9, port_per_gpu=True), gpus_per_node=8, algorithm="ring")
    assert per_gpu.collective_seconds("all_reduce", size, 16) == pytest.approx(48e-6 + size * 30 / 16 / 100e9)


def test_auto_takes_the_tree_for_small_all_reduces_across_many_nodes_and_the_ring_for_large() -> None:
    machine = Machine(Link("nv", 1e-6, 300e9), Link("ib", 5e-6, 300e9, port_per_gpu=False), gpus_per_node=8)
    ring, tree = replace(machine, algorithm="ring"), replace(machine, algorithm="tree")
    n = 1024  # 128 nodes: the ring's 2046 steps (254 crossing nodes) against the tree's 2 x (7 + 7)
    assert tree.collective_seconds("all_reduce", 0, n) == pytest.approx(2 * (7 * 1e-6 + 7 * 5e-6))
    assert machine.collective_seconds("all_reduce", 0, n) == tree.collective_seconds("all_reduce", 0, n)
    large = 4 * 2**30
    assert ring.collective_seconds("all_reduce", large, n) < tree.collective_seconds("all_reduce", large, n)
    assert machine.collective_seconds("all_reduce", large, n) == ring.collective_seconds("all_reduce", large, n)
    assert machine.collective_seconds("all_gather", 0, n) == ring.collective_seconds("all_gather", 0, n)  # rings only


def test_dgx1_bandwidth_follows_the_gpus_a_job_spans() -> None:
    dgx1 = LINKS["dgx1-v100"]
    assert [dgx1.busbw_at(n) / 1e9 for n in (2, 4, 8)] == [22, 87, 130]


def test_a_link_is_a_preset_or_its_figures() -> None:
    assert parse_link("ib-400g") is LINKS["ib-400g"]
    given = parse_link("25,4.5")
    assert (given.busbw_bytes_per_second, given.latency_seconds) == (25e9, pytest.approx(4.5e-6))
    for bad in ("fast", "25", "0,1", "25,-1"):
        with pytest.raises(ValueError, match="BUSBW|bus bandwidth"):
            parse_link(bad)


def test_a_bad_link_is_one_line(capsys) -> None:
    err = _simulate_error(capsys, ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--local-step-ms", "10",
                                   "--link", "fast"])
    assert "--link: expected a preset" in err
    err = _simulate_error(capsys, ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--local-step-ms", "10",
                                   "--link", "nvlink-h100", "--gpus-per-node", "8"])
    assert "give --inter-link" in err


def test_gradients_are_ready_by_forward_flops_not_by_parameter_count() -> None:
    """A stem convolution over a large image (few parameters, most FLOPs) then a large linear head
    (many parameters, few FLOPs): the head's gradient is ready at once, the stem's at the end."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 64 * 64, 10))
    with torch.device("meta"):
        model = model.to("meta")
        gradients = gradients_by_flops(model, torch.empty(4, 3, 64, 64, device="meta"))
    names = [g.name for g in gradients]
    assert names == ["2.bias", "2.weight", "0.bias", "0.weight"]
    conv = 2 * 4 * 8 * 3 * 9 * 64 * 64
    linear = 2 * 4 * 8 * 64 * 64 * 10
    fractions = {g.name: g.ready_fraction for g in gradients}
    assert fractions["2.weight"] == pytest.approx(linear / (conv + linear))
    assert fractions["0.weight"] == 1.0
    assert ready_times(gradients, 2.0) == pytest.approx([2.0 * fractions[n] for n in names])


def test_fsdp_in_bf16_gathers_half_the_bytes_and_reduces_in_fp32() -> None:
    link = Link("bandwidth only", latency_seconds=0.0, busbw_bytes_per_second=1e9)
    gradients, module = gradients_in_backward_order("tiny", 32), module_of("tiny")
    total = sum(g.size_bytes for g in gradients)
    n, share = 8, 7 / 8
    bf16 = Sent(precision="bf16")
    comm = predict_step("fsdp", None, Compute(1.0), gradients, link, n, module=module, gather_scale=bf16.gather_scale("fsdp"))
    assert comm.comm_seconds == pytest.approx((2 * 0.5 + 1) * share * total / 1e9)
    assert Sent(precision="bf16").gather_scale("bucketed") == 1.0  # DDP's gradients are fp32 whatever autocast does
    halved = Sent(grad_comm="bf16").gradients("bucketed", gradients)
    assert sum(g.size_bytes for g in halved) == total // 2 and {g.element_size for g in halved} == {2}


def test_the_terms_add_up_and_the_fixed_step_is_calibrated_on_a_measured_step() -> None:
    gradients = gradients_in_backward_order("tiny", 32)
    link = Link("l", 10e-6, 1e9)
    costs = Overheads(fixed_step_seconds=0.0, collective_seconds=None, rank_variation=0.02)
    shape = StepShape(2, 32)
    calibrated = calibrate_on_measured("tiny", shape, "bucketed", 1.0, link, {1: 0.103}, 0.100, costs)
    assert calibrated.overheads.fixed_step_seconds == pytest.approx(0.003)  # one rank: nothing crosses a link
    terms = predict_step("bucketed", 1.0, calibrated.compute, gradients, link, 8, overheads=calibrated.overheads)
    assert terms.step_seconds == pytest.approx(terms.compute_seconds + terms.fixed_step_seconds + terms.fixed_collective_seconds
                                               + terms.rank_wait_seconds + terms.exposed_comm_seconds)
    assert terms.fixed_collective_seconds == pytest.approx(terms.collectives_per_step * link.small_message_seconds(8))
    assert terms.rank_wait_seconds == pytest.approx(0.02 * 0.100 * expected_max_of_normals(8))
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)  # E[max of 2] = 1/sqrt(pi)
    # without a local step, the compute is what meets the measured step
    solved = calibrate_on_measured("tiny", shape, "bucketed", 1.0, link, {8: terms.step_seconds}, None, costs)
    assert solved.compute.step_seconds + 0.003 == pytest.approx(0.100 + 0.003, rel=0.05)
    assert solved.residuals_seconds[8] == pytest.approx(0.0, abs=1e-9)


def test_a_one_gpu_run_gives_each_strategy_its_fixed_step_as_the_published_one_gpu_row_does(tmp_path, capsys) -> None:
    """PyTorch's DDP on one GPU costs its hooks and copies and nothing on a link: a run at one rank
    calibrates that, which every world size is then charged."""
    def bench(strategy, bucket, seconds):
        record = synthetic.step(synthetic.config(strategy, bucket_size_mb=bucket), [seconds] * 3, backend="nccl",
                                device="NVIDIA H100", world_size=1, num_parameters=259_392)
        return synthetic.step_benchmark(record)

    path = write_run(tmp_path / "one_gpu.json", [bench("local", None, 0.097), bench("torch", 25.0, 0.100)])
    predictions = tmp_path / "predictions.json"
    argv = ["simulate", "--from", str(path), "--link", "nvlink-h100", "--world-sizes", "1,8", "--json", str(predictions)]
    assert ddp_main(argv) == 0
    assert "  torch 25 MiB 3.00 [3.00]" in capsys.readouterr().out
    torch_rows = {p.world_size: p for p in load_records(predictions, PredictionRecord) if p.strategy == "torch"}
    assert torch_rows[1].step_seconds == pytest.approx(0.100)
    assert torch_rows[8].fixed_step_seconds == pytest.approx(0.003) and torch_rows[8].step_seconds > 0.100


def test_powersgd_sends_its_compressed_bytes():
    """``torch_powersgd``'s schedule: per bucket the tensors it leaves whole, then n r and m r
    elements a compressed matrix (its Ps and Qs); a matrix too small to shrink 2x goes whole."""
    from ddp.strategies.torch_powersgd import compressed_buckets, compresses

    gradients = [Gradient("bias", 64 * 4, 0.0, shape=(64,)), Gradient("weight", 64 * 32 * 4, 1.0, shape=(64, 32)),
                 Gradient("small", 3 * 3 * 4, 1.0, shape=(3, 3))]
    assert [compresses(g.shape, 1) for g in gradients] == [False, True, False]
    (whole, ps, qs) = compressed_buckets(gradients, [0.1, 0.2, 0.3], 0.5, 25.0)
    assert (whole.size_bytes, ps.size_bytes, qs.size_bytes) == ((64 + 9) * 4, 64 * 4, 32 * 4)
    assert whole.ready_seconds == ps.ready_seconds == qs.ready_seconds == 0.3
    assert [t.size_bytes for t in compressed_buckets(gradients, [0.1, 0.2, 0.3], 0.5, 25.0, rank=4)][1:] == [64 * 4 * 4, 32 * 4 * 4]
