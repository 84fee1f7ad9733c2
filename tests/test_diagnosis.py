"""A DDP class that trains differently from one process fails with a message that says how.

The first tests run the deliberately wrong classes of ``wrong_ddps`` through the correctness
suite's own ``train_against_reference``. Each one must fail, and its message must name the
parameter and give the hint for its mistake and no other. The rest are unit tests of
``correctness_tests.diagnose`` on tensors made by hand, with no ranks.
"""

from __future__ import annotations

import math
import re
import time

import pytest
import torch

from correctness_tests.diagnose import (
    Mismatch,
    diagnose_initial,
    diagnose_step,
    frozen_names,
    named_buffer_values,
    named_gradients,
    named_ties,
    named_values,
)
from correctness_tests.models import FrozenMLP, TiedLM
from correctness_tests.training import train_against_reference
from ddp.launcher import RankError
from tests.on_ranks import sum_of_ranks

WRONG = "tests.wrong_ddps:"

# A phrase that only its own hint contains. A message must give the right hint and no other.
HINTS = {
    "broadcast": "not broadcast from rank 0",
    "summed": "summed, not averaged",
    "tied": "reduced once for each of its names",
    "frozen": "has requires_grad=False",
    "unused": "got no gradient in single-process training differ",
    "missing": "never synchronized",
    "not_reduced": "not all-reduced",
    "value": "every gradient matched",
    "never_stepped": "its shard was never stepped",
    "not_gathered": "was not gathered back",
    "stepped_twice": "stepped more than once",
}


def hints_in(text: str) -> set[str]:
    return {key for key, phrase in HINTS.items() if phrase in text}


# --- The wrong classes, through the correctness suite ---------------------------------------


@pytest.mark.parametrize("model_name", ["frozen_mlp", "tied_lm", "routed_mlp"])
def test_the_wrong_classes_base_trains_like_one_process(rank_group, model_name):
    """SimpleDDP passes, so each wrong class below fails because of the one thing it changes."""
    rank_group.run(train_against_reference, WRONG + "SimpleDDP", None, model_name, "adamw", 2)


WRONG_CASES = [
    # class, the model that exposes its mistake, optimizer, the parameter and quantity that
    # the message must name first, the hint it must give
    ("SumsInsteadOfAverages", "frozen_mlp", "sgd", "fc1.weight", "gradient", "summed"),
    ("NoBroadcast", "frozen_mlp", "sgd", "temperature", "initial value", "broadcast"),
    ("ReducesTiedTwice", "tied_lm", "sgd", "embedding.weight", "gradient", "tied"),
    ("ChangesFrozen", "frozen_mlp", "adamw", "temperature", "gradient", "frozen"),
    ("ZerosForUnused", "routed_mlp", "adamw", "experts.2.weight", "gradient", "unused"),
    ("NeverSynchronizes", "frozen_mlp", "sgd", "fc1.weight", "gradient", "not_reduced"),
]
# With one rank these classes train exactly like one process: the mistake cannot show.
ONE_RANK_HIDES = {
    "SumsInsteadOfAverages": "a sum over one rank is its average",
    "NoBroadcast": "there is no other rank to start from other parameters",
    "ReducesTiedTwice": "summing twice over one rank changes nothing",
    "NeverSynchronizes": "one rank's own gradient is the whole batch's",
}


@pytest.mark.parametrize(
    "cls, model_name, optimizer_name, name, quantity, hint", WRONG_CASES, ids=[case[0] for case in WRONG_CASES]
)
def test_a_wrong_class_fails_with_its_diagnosis(rank_group, cls, model_name, optimizer_name, name, quantity, hint):
    if rank_group.world_size < 2 and cls in ONE_RANK_HIDES:
        pytest.skip(f"needs 2 ranks: a wrong class cannot show with one rank ({ONE_RANK_HIDES[cls]})")
    with pytest.raises(RankError) as raised:
        rank_group.run(train_against_reference, WRONG + cls, None, model_name, optimizer_name, 1)
    message = str(raised.value)
    # Only rank 1 starts from other parameters than rank 0; any rank can fail a step.
    when = "before the first step, rank 1" if quantity == "initial value" else r"step 0, rank \d"
    where = rf"AssertionError: {when}, parameter {re.escape(repr(name))}: .*\({quantity}\)"
    assert re.search(where, message), message
    assert hints_in(message) == {hint}, message


SHARDED = "tests.wrong_sharded:"
WRONG_SHARDED_CASES = [
    # class, model, optimizer, a pattern of the parameter named first, the hint
    ("StepsShardTwice", "frozen_mlp", "adamw", r"fc1\.weight", "stepped_twice"),
    # rank 0 owns the largest tensor, fc1.weight, at every world size
    ("FirstRankNeverSteps", "frozen_mlp", "adamw", r"fc1\.weight", "never_stepped"),
    # each rank names a parameter another rank owns
    ("NeverGathersBack", "frozen_mlp", "adamw", r"fc[12]\.weight", "not_gathered"),
    # FSDP compares values only: with SGD, summed gradients make a world-size-times update
    ("SumsShardedGradients", "frozen_mlp", "sgd", r"fc1\.weight", "summed"),
]


@pytest.mark.parametrize(
    "cls, model_name, optimizer_name, name, hint", WRONG_SHARDED_CASES, ids=[case[0] for case in WRONG_SHARDED_CASES]
)
def test_a_wrong_sharded_class_fails_with_its_diagnosis(rank_group, cls, model_name, optimizer_name, name, hint):
    """A user's sharded optimizer (the course's shape, adapted by the registry) or FSDP class with one
    mistake fails, and the message names the parameter and the mistake."""
    if rank_group.world_size < 2 and hint in ("not_gathered", "summed"):
        pytest.skip(f"{cls}'s mistake changes nothing with one rank: run with --world-size 2 or more")
    with pytest.raises(RankError) as raised:
        rank_group.run(train_against_reference, SHARDED + cls, None, model_name, optimizer_name, 1)
    message = str(raised.value)
    assert re.search(rf"AssertionError: step 0, rank \d, parameter '{name}': .*\(value\)", message), message
    assert hints_in(message) == {hint}, message


# --- Collectives that differ between ranks, named before the backend crashes ------------------

UNUSED_HINT = "parameters unused on some ranks: a DDP must still reduce them, as PyTorch's does with find_unused_parameters=True"


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["step", "no_sync"])
@pytest.mark.ranks(2, why="with one rank every parameter a rank leaves unused is unused everywhere")
def test_a_per_parameter_ddp_that_skips_unused_parameters_is_named_and_the_group_kept(rank_group, micro_batches):
    """The textbook per-parameter DDP all-reduces only the gradients this rank produced: on the
    routed model the ranks' collectives differ. Named within seconds, on every rank; then the
    same group runs the next call."""
    rank_group.run(sum_of_ranks)  # started, so the time below is the check's own
    started, began = rank_group.starts, time.monotonic()
    with pytest.raises(RankError) as raised:
        rank_group.run(train_against_reference, WRONG + "PerParameterDDP", None, "routed_mlp", "sgd", micro_batches)
    assert time.monotonic() - began < 20
    message = str(raised.value)
    assert f"{rank_group.world_size} of {rank_group.world_size} ranks of " in message
    assert message.count("step 0: the ranks issued different collectives") == rank_group.world_size, message
    assert re.search(r"rank 0: collective \d+: all_reduce\(float32\[3(, 8)?\], op=SUM\) of 'experts\.0\.(weight|bias)' gradient", message), message
    last = rank_group.world_size - 1  # its rows all go to expert 1 (models.RoutedMLP)
    assert UNUSED_HINT in message and f"rank {last} did not use 'experts.0.bias', 'experts.0.weight'" in message, message
    assert "Connection reset" not in message and "died" not in message
    assert rank_group.run(sum_of_ranks) == [sum(range(rank_group.world_size))] * rank_group.world_size
    assert rank_group.starts == started, "a mismatch caught before the backend leaves the group in step"


@pytest.mark.ranks(2, why="one rank's collectives cannot differ from another's")
def test_a_collective_only_one_rank_issues_is_named_with_the_count(rank_group):
    with pytest.raises(RankError) as raised:
        rank_group.run(train_against_reference, WRONG + "ExtraCollectiveOnRankZero", None, "frozen_mlp", "sgd", 1)
    message = str(raised.value)
    assert re.search(r"rank 0: collective (\d+): barrier\(\)\n  rank 1: ended step 0 after \d+ collective\(s\)", message), message
    assert "a collective that depends on the rank or its data" in message and UNUSED_HINT not in message


# --- diagnose_step on tensors made by hand ---------------------------------------------------


def step_of(reference_grads, actual_grads, reference_params=None, actual_params=None, world_size=2, **kwargs):
    """diagnose_step at step 0 on rank 1. Parameters default to equal ones."""
    if reference_params is None:
        reference_params = {name: torch.ones(3) for name in reference_grads}
    if actual_params is None:
        actual_params = {name: value.clone() for name, value in reference_params.items()}
    return diagnose_step(0, 1, world_size, reference_grads, actual_grads, reference_params, actual_params, **kwargs)


def by_name(**named):
    """Dots in names are spelled as double underscores: by_name(fc1__weight=...)."""
    return {name.replace("__", "."): value for name, value in named.items()}


def test_the_sum_is_measured():
    """The message gives the factor and the sizes of the difference, not only a verdict."""
    reference = {"fc1.weight": torch.tensor([0.32, -0.1]), "fc1.bias": torch.tensor([0.05])}
    mismatch = step_of(reference, {name: 2 * grad for name, grad in reference.items()})
    assert str(mismatch).splitlines()[0] == (
        "step 0, rank 1, parameter 'fc1.weight': largest absolute difference 3.2e-01, "
        "largest relative difference 1.0e+00 (gradient)"
    )
    assert "hint: the gradient is 2.00x the single-process one, the world size" in str(mismatch)
    assert mismatch.also_differ == ("fc1.bias",)


def test_equal_within_tolerance_is_no_mismatch():
    reference = by_name(w=torch.tensor([1.0, -2.0]), b=torch.tensor([0.0]))
    assert step_of(reference, by_name(w=torch.tensor([1.00005, -2.0]), b=torch.tensor([5e-6]))) is None


def test_a_difference_past_tolerance_is_a_mismatch():
    reference = by_name(w=torch.tensor([1.0, -2.0]))
    mismatch = step_of(reference, by_name(w=torch.tensor([1.001, -2.0])))
    assert mismatch is not None
    assert mismatch.name == "w" and mismatch.quantity == "gradient" and mismatch.hint is None
    assert mismatch.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    assert mismatch.max_rel_diff == pytest.approx(1e-3, rel=1e-3)


def test_nan_is_a_mismatch():
    mismatch = step_of(by_name(w=torch.tensor([1.0])), by_name(w=torch.tensor([math.nan])))
    assert mismatch is not None and mismatch.name == "w"


def test_summed_gradients_at_another_world_size():
    reference = by_name(w=torch.tensor([1.0, -2.0]))
    mismatch = step_of(reference, by_name(w=4 * reference["w"]), world_size=4)
    assert "4.00x the single-process one, the world size" in mismatch.hint


def test_a_factor_other_than_the_world_size_is_not_called_summed():
    reference = by_name(w=torch.tensor([1.0, -2.0]))
    assert step_of(reference, by_name(w=2 * reference["w"]), world_size=4).hint is None


def test_summed_needs_every_difference_to_be_the_world_size():
    reference = by_name(a=torch.tensor([1.0, -2.0]), b=torch.tensor([3.0]))
    assert step_of(reference, by_name(a=2 * reference["a"], b=torch.tensor([1.0]))).hint is None


TIES = (("embedding.weight", "output.weight"),)


def test_only_the_tied_weight_off_is_reduced_twice():
    reference = by_name(embedding__weight=torch.tensor([1.0, 2.0]), hidden__weight=torch.tensor([3.0]))
    actual = by_name(embedding__weight=torch.tensor([2.0, 4.0]), hidden__weight=torch.tensor([3.0]))
    mismatch = step_of(reference, actual, tied=TIES)
    assert mismatch.name == "embedding.weight"
    assert hints_in(mismatch.hint) == {"tied"}
    assert "2.00x" in mismatch.hint and "'output.weight'" in mismatch.hint


def test_every_gradient_doubled_with_a_tied_weight_is_summed():
    reference = by_name(embedding__weight=torch.tensor([1.0, 2.0]), hidden__weight=torch.tensor([3.0]))
    actual = {name: 2 * grad for name, grad in reference.items()}
    assert hints_in(step_of(reference, actual, tied=TIES).hint) == {"summed"}


def test_a_frozen_parameter_with_a_gradient():
    reference = by_name(w=torch.tensor([1.0]), temperature=None)
    actual = by_name(w=torch.tensor([1.0]), temperature=torch.zeros(()))
    mismatch = step_of(reference, actual, frozen={"temperature"})
    assert mismatch.name == "temperature"
    assert hints_in(mismatch.hint) == {"frozen"}
    assert mismatch.detail == "the gradient is a tensor of zeros here, None in single-process training"


def test_a_frozen_parameter_that_moved():
    same = by_name(w=torch.tensor([1.0]), temperature=None)
    params = by_name(w=torch.tensor([1.0]), temperature=torch.tensor(1.5))
    moved = by_name(w=torch.tensor([1.0]), temperature=torch.tensor(1.4))
    mismatch = step_of(same, dict(same), params, moved, frozen={"temperature"})
    assert mismatch.name == "temperature" and mismatch.quantity == "value"
    assert hints_in(mismatch.hint) == {"frozen"}


def test_only_unused_parameters_with_zeros():
    reference = by_name(used=torch.tensor([1.0]), experts__2__weight=None, experts__2__bias=None)
    actual = by_name(used=torch.tensor([1.0]), experts__2__weight=torch.zeros(2), experts__2__bias=torch.zeros(1))
    mismatch = step_of(reference, actual)
    assert mismatch.name == "experts.2.weight" and mismatch.also_differ == ("experts.2.bias",)
    assert hints_in(mismatch.hint) == {"unused"}
    assert mismatch.max_abs_diff == 0.0  # zeros against None: the detail says what differs
    assert "tensor of zeros here, None" in mismatch.detail


def test_unused_zeros_and_a_wrong_used_gradient_is_not_only_unused():
    reference = by_name(used=torch.tensor([1.0]), unused=None)
    actual = by_name(used=torch.tensor([1.5]), unused=torch.zeros(1))
    assert step_of(reference, actual).hint is None


def test_a_missing_gradient():
    reference = by_name(w=torch.tensor([1.0]), experts__0__weight=torch.tensor([0.5, -0.25]))
    actual = by_name(w=torch.tensor([1.0]), experts__0__weight=None)
    mismatch = step_of(reference, actual)
    assert mismatch.name == "experts.0.weight"
    assert hints_in(mismatch.hint) == {"missing"}
    assert mismatch.detail == "the gradient is None here, a tensor in single-process training"
    assert mismatch.max_abs_diff == 0.5 and mismatch.max_rel_diff == 1.0


def test_this_ranks_own_gradient_was_never_reduced():
    reference = by_name(w=torch.tensor([1.0, 2.0]))
    mine = by_name(w=torch.tensor([0.5, 3.0]))
    assert hints_in(step_of(reference, mine, local_grads=mine).hint) == {"not_reduced"}
    assert step_of(reference, mine).hint is None  # without this rank's own gradient, no guess


def test_matching_gradients_and_different_values():
    same = by_name(w=torch.tensor([1.0]), b=torch.tensor([2.0]))
    params = by_name(w=torch.tensor([1.0]), b=torch.tensor([2.0]))
    moved = by_name(w=torch.tensor([1.0]), b=torch.tensor([2.5]))
    mismatch = step_of(same, dict(same), params, moved)
    assert mismatch.name == "b" and mismatch.quantity == "value"
    assert hints_in(mismatch.hint) == {"value"}


def test_gradients_are_reported_before_values():
    reference = by_name(w=torch.tensor([1.0]), b=torch.tensor([2.0]))
    actual = by_name(w=torch.tensor([1.0]), b=torch.tensor([9.0]))  # b's gradient differs
    params = by_name(w=torch.tensor([1.0]), b=torch.tensor([2.0]))
    moved = by_name(w=torch.tensor([7.0]), b=torch.tensor([2.0]))  # w's value differs, and comes first
    mismatch = step_of(reference, actual, params, moved)
    assert mismatch.name == "b" and mismatch.quantity == "gradient"


def test_a_shape_mismatch():
    mismatch = step_of(by_name(w=torch.ones(2, 3)), by_name(w=torch.ones(3, 2)))
    assert mismatch.max_abs_diff == math.inf
    assert mismatch.detail == "the gradient has shape (3, 2) here, (2, 3) in single-process training"


def test_parameters_named_differently_is_an_error():
    with pytest.raises(ValueError, match=r"missing \['w'\], unexpected \['module.w'\]"):
        step_of(by_name(w=torch.ones(1)), by_name(module__w=torch.ones(1)))


def test_a_long_list_of_other_mismatches_is_cut():
    reference = {f"layer{i}": torch.ones(1) for i in range(8)}
    text = str(step_of(reference, {name: 3 * grad for name, grad in reference.items()}))
    assert "also differ (gradient): 'layer1', 'layer2', 'layer3', 'layer4', 'layer5' and 2 more" in text


# --- diagnose_initial -------------------------------------------------------------------------


def test_a_rank_that_kept_its_own_parameters():
    rank0 = by_name(fc1__weight=torch.tensor([0.5, -0.5]), fc1__bias=torch.tensor([0.1]))
    mine = {name: value + 1 for name, value in rank0.items()}
    mismatch = diagnose_initial(1, rank0, mine)
    assert str(mismatch).startswith(
        "before the first step, rank 1, parameter 'fc1.weight': largest absolute difference 1.0e+00, "
        "largest relative difference 2.0e+00 (initial value)"
    )
    assert hints_in(mismatch.hint) == {"broadcast"}


def test_a_wrapper_that_changed_rank_0s_parameters():
    mismatch = diagnose_initial(0, by_name(w=torch.ones(2)), by_name(w=torch.zeros(2)))
    assert "changed rank 0's own parameters" in mismatch.hint and hints_in(mismatch.hint) == set()


def test_buffers_not_broadcast():
    mismatch = diagnose_initial(1, {"shift": torch.zeros(4)}, {"shift": torch.ones(4)}, kind="buffer")
    assert str(mismatch).startswith("before the first step, rank 1, buffer 'shift'")
    assert "buffers were not broadcast" in mismatch.hint


def test_same_initial_values():
    assert diagnose_initial(1, by_name(w=torch.ones(2)), by_name(w=torch.ones(2))) is None


def test_a_mismatch_is_frozen():
    mismatch = diagnose_initial(1, by_name(w=torch.ones(1)), by_name(w=torch.zeros(1)))
    with pytest.raises(AttributeError):
        mismatch.name = "other"  # type: ignore[misc]
    assert isinstance(mismatch, Mismatch)


# --- Gathering the inputs from a module -------------------------------------------------------


def test_ties_and_frozen_names_of_the_test_models():
    assert named_ties(TiedLM()) == (("embedding.weight", "output.weight"),)
    assert named_ties(FrozenMLP()) == ()
    assert frozen_names(FrozenMLP()) == {"fc1.bias", "temperature"}


def test_named_copies_are_copies():
    model = FrozenMLP()
    model(torch.randn(2, 8)).sum().backward()
    gradients, values, buffers = named_gradients(model), named_values(model), named_buffer_values(model)
    assert list(gradients) == [name for name, _ in model.named_parameters()]
    assert gradients["fc1.bias"] is None and gradients["fc1.weight"] is not None
    before = gradients["fc1.weight"].clone(), values["fc1.weight"].clone(), buffers["shift"].clone()
    with torch.no_grad():
        model.fc1.weight.grad.add_(1.0)
        model.fc1.weight.add_(1.0)
        model.shift.add_(1.0)
    assert torch.equal(gradients["fc1.weight"], before[0])
    assert torch.equal(values["fc1.weight"], before[1])
    assert torch.equal(buffers["shift"], before[2])
