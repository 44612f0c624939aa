"""OnPolicyDataModule: deterministic data positions, a new permutation per epoch, resumable position,
rollouts made only for training batches."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from lopd_lightning.data import OnPolicyDataModule, RolloutSource
from lopd_lightning.tasks.toy import ToyTask


def ids(examples) -> list[str]:
    return [ex.id for ex in examples]


def test_examples_at_is_deterministic_across_instances():
    a = OnPolicyDataModule("toy", examples_per_step=5, seed=3)
    b = OnPolicyDataModule("toy", examples_per_step=5, seed=3)
    for position in (0, 5, 23, 24, 50):
        assert ids(a.examples_at(position)) == ids(b.examples_at(position))
    c = OnPolicyDataModule("toy", examples_per_step=5, seed=4)
    assert [ids(a.examples_at(p)) for p in range(0, 24, 5)] != [ids(c.examples_at(p)) for p in range(0, 24, 5)]


def test_positions_wrap_per_epoch_with_a_new_permutation():
    dm = OnPolicyDataModule("toy", examples_per_step=1, seed=0)
    pool = ids(dm.train_examples)
    n = len(pool)
    assert n == 24  # 32 toy examples, ceil(0.25 * 32) = 8 held out
    epoch0 = [dm.examples_at(p)[0].id for p in range(n)]
    epoch1 = [dm.examples_at(p)[0].id for p in range(n, 2 * n)]
    # each epoch is a permutation of the whole train split, and the two permutations differ
    assert sorted(epoch0) == sorted(pool) and sorted(epoch1) == sorted(pool)
    assert epoch0 != epoch1
    # the naive reference: position p -> entry p % N of epoch p // N's seeded shuffle
    for p in (0, 7, n - 1, n, n + 5, 3 * n + 2):
        epoch, offset = divmod(p, n)
        order = list(range(n))
        random.Random(0 * 1_000_003 + epoch).shuffle(order)
        assert dm.examples_at(p)[0].id == pool[order[offset]]


def test_a_step_across_the_epoch_boundary_takes_from_both_epochs():
    one = OnPolicyDataModule("toy", examples_per_step=1)
    four = OnPolicyDataModule("toy", examples_per_step=4)
    n = len(one.train_examples)
    expected = [one.examples_at(p)[0].id for p in range(n - 2, n + 2)]  # last two of epoch 0, first two of epoch 1
    assert ids(four.examples_at(n - 2)) == expected


@pytest.mark.parametrize("key", ["train_limit", "val_limit"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_a_limit_below_one_is_refused_not_read_as_all_or_a_cut_from_the_end(key, value):
    # 0 read as "all" and -1 as examples[:-1] before: a silent wrong split
    with pytest.raises(ValueError, match=f"data.init_args.{key} must be an int >= 1, or null"):
        OnPolicyDataModule("toy", **{key: value})


def test_train_limit_restricts_the_pool():
    dm = OnPolicyDataModule("toy", examples_per_step=3, train_limit=3)
    first3 = ids(ToyTask().examples("train")[:3])
    assert ids(dm.train_examples) == first3
    assert sorted(ids(dm.examples_at(0))) == sorted(first3)


def test_state_dict_round_trip_restores_the_position_and_the_stream():
    dm = OnPolicyDataModule("toy", examples_per_step=2, seed=1)
    dm.position = 10
    state = dm.state_dict()
    assert state == {"position": 10, "seed": 1}
    other = OnPolicyDataModule("toy", examples_per_step=2, seed=1)
    other.load_state_dict(state)
    assert other.position == 10
    stream = iter(other.train_dataloader())
    assert ids(next(stream)) == ids(dm.examples_at(10))
    assert ids(next(stream)) == ids(dm.examples_at(12))


class FakeModule:
    def __init__(self):
        self.calls = []

    def make_batch(self, task, examples):
        self.calls.append((task, list(examples)))
        return ("rollouts", len(examples))


def test_on_before_batch_transfer_makes_rollouts_for_training_only():
    dm = OnPolicyDataModule("toy", examples_per_step=2)
    module = FakeModule()
    examples = dm.examples_at(0)

    # no trainer attached yet: pass through
    assert dm.on_before_batch_transfer(examples, 0) is examples

    # validation (trainer not training): the example list is returned unchanged, nothing generated
    dm.trainer = SimpleNamespace(training=False, lightning_module=module, world_size=1, global_rank=0)
    assert dm.on_before_batch_transfer(examples, 0) is examples
    assert dm.position == 0 and module.calls == []

    # training: the module's make_batch gets the task and the examples; the position advances
    dm.trainer = SimpleNamespace(training=True, lightning_module=module, world_size=1, global_rank=0)
    dm.setup("fit")  # binds the trainer's module as the rollout source
    assert dm.rollout_source is module
    assert dm.on_before_batch_transfer(examples, 0) == ("rollouts", 2)
    assert module.calls == [(dm.task, examples)]
    assert dm.position == 2


def test_val_loader_serves_example_lists_in_order():
    dm = OnPolicyDataModule("toy", val_limit=5, val_batch_size=2)
    batches = list(dm.val_dataloader())
    assert [len(b) for b in batches] == [2, 2, 1]
    assert [ex.id for b in batches for ex in b] == ids(ToyTask().examples("val")[:5])
    assert dm.transfer_batch_to_device(batches[0], "cpu", 0) is batches[0]  # lists stay on the host


def test_a_dev_slice_of_the_train_split_replaces_validation_and_leaves_training():
    train = ToyTask().examples("train")
    dm = OnPolicyDataModule("toy", examples_per_step=2, dev_slice=6, dev_slice_seed=0, val_batch_size=4)
    chosen = sorted(random.Random(0).sample(range(len(train)), 6))  # benchmarks/start_student.py's draw
    assert ids(dm.val_examples) == [train[i].id for i in chosen]
    assert ids(dm.train_examples) == [ex.id for i, ex in enumerate(train) if i not in chosen]
    assert [ex.id for b in dm.val_dataloader() for ex in b] == ids(dm.val_examples)
    # no training step ever draws a dev question, over several epochs
    drawn = {ex.id for p in range(0, 4 * len(dm.train_examples), 2) for ex in dm.examples_at(p)}
    assert drawn == set(ids(dm.train_examples)) and not drawn & set(ids(dm.val_examples))
    assert not set(ids(dm.val_examples)) & set(ids(ToyTask().examples("val")))  # never the held-out split
    assert dm.example(dm.val_examples[0].id) is dm.val_examples[0]
    # val_limit limits the slice, another seed draws another slice
    assert ids(OnPolicyDataModule("toy", dev_slice=6, val_limit=2).val_examples) == ids(dm.val_examples[:2])
    assert ids(OnPolicyDataModule("toy", dev_slice=6, dev_slice_seed=1).val_examples) != ids(dm.val_examples)
    with pytest.raises(ValueError, match=rf"data.init_args.dev_slice must be in \[1, {len(train) - 1}\].*got {len(train)}"):
        _ = OnPolicyDataModule("toy", dev_slice=len(train)).train_examples
    with pytest.raises(ValueError, match=r"^data.init_args.dev_slice must be an int >= 1, or null for the val split; got 0$"):
        OnPolicyDataModule("toy", dev_slice=0)  # refused at once (lopd fit: before the student loads)


def test_example_lookup_and_bad_options():
    dm = OnPolicyDataModule("toy")
    val_id = dm.val_examples[0].id
    assert dm.example(val_id).id == val_id
    with pytest.raises(KeyError, match="no example with id"):
        dm.example("toy/999")
    with pytest.raises(ValueError, match=r"^data.init_args.examples_per_step must be an int >= 1, got 0$"):
        OnPolicyDataModule("toy", examples_per_step=0)
    with pytest.raises(ValueError, match="task_options are only for a task given by name"):
        OnPolicyDataModule(ToyTask(), task_options={"seed": 1})


def test_ddp_ranks_read_disjoint_slices_of_one_stream_and_position_counts_all_ranks():
    """With W ranks, rank r's k-th batch is slice (k*W + r) of the single-process stream; no task is shared."""
    from lopd_lightning.data import _ExampleStream

    dm = OnPolicyDataModule("toy", examples_per_step=3)
    single = [dm.examples_at(3 * i) for i in range(4)]
    per_rank = []
    for rank in range(2):
        dm.trainer = SimpleNamespace(training=True, world_size=2, global_rank=rank, lightning_module=None)
        stream = iter(_ExampleStream(dm))
        per_rank.append([next(stream) for _ in range(2)])
    assert per_rank[0] == [single[0], single[2]] and per_rank[1] == [single[1], single[3]]
    ids = [ex.id for batches in per_rank for batch in batches for ex in batch]
    assert len(ids) == len(set(ids)) == 12  # 12 of the 24 train examples, none twice

    class Maker:
        def make_batch(self, task, examples):
            return len(examples)

    dm.trainer = SimpleNamespace(training=True, world_size=2, global_rank=0, lightning_module=Maker())
    dm.setup("fit")
    dm.position = 0
    assert dm.on_before_batch_transfer(single[0], 0) == 3
    assert dm.position == 6  # both ranks consumed 3 examples


def test_the_rollout_source_is_bound_explicitly_and_a_module_without_one_fails_clearly():
    dm = OnPolicyDataModule("toy", examples_per_step=2)
    examples = dm.examples_at(0)
    assert isinstance(FakeModule(), RolloutSource) and not isinstance(object(), RolloutSource)

    # training before any binding: a clear error, and the data position does not move
    dm.trainer = SimpleNamespace(training=True, lightning_module=FakeModule(), world_size=1, global_rank=0)
    with pytest.raises(RuntimeError, match="no rollout source"):
        dm.on_before_batch_transfer(examples, 0)
    assert dm.position == 0

    # fitting a LightningModule that cannot make batches: the error names it and the interface
    class NoBatches:
        pass

    dm.trainer = SimpleNamespace(training=True, lightning_module=NoBatches(), world_size=1, global_rank=0)
    with pytest.raises(TypeError, match=r"NoBatches cannot serve on-policy batches.*make_batch\(task, examples\)"):
        dm.setup("fit")
    dm.setup("validate")  # validation needs no rollouts: nothing bound, no error
    assert dm.rollout_source is None

    # any object with make_batch can be bound by hand (a tool, a test)
    source = FakeModule()
    dm.bind_rollout_source(source)
    dm.trainer = SimpleNamespace(training=True, lightning_module=None, world_size=1, global_rank=0)
    assert dm.on_before_batch_transfer(examples, 0) == ("rollouts", 2) and source.calls == [(dm.task, examples)]
