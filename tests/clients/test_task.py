"""The public task interface: examples in every accepted form, lazy users, the losses' checks, task references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fed_dp.clients import losses
from fed_dp.clients.task import Examples, Task, Users, load_task
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.simulations.engine.inprocess import train


def test_examples_from_tuples_dicts_tensors_arrays_and_datasets():
    x, y = torch.randn(5, 3), torch.arange(5)
    assert Examples.of((x, y)).select(torch.tensor([1, 2]))[1].tolist() == [1, 2]
    as_dict = Examples.of({"inputs": x, "labels": y})
    assert set(as_dict.select(slice(0, 2))) == {"inputs", "labels"} and len(as_dict) == 5
    assert len(Examples.of(np.zeros((4, 2), dtype=np.float32))) == 4
    dataset = torch.utils.data.TensorDataset(x, y)
    collated = Examples.of(dataset)
    assert torch.equal(collated.fields[0], x) and torch.equal(collated.fields[1], y)
    with pytest.raises(ValueError, match="share their first dimension"):
        Examples.of((torch.zeros(3, 2), torch.zeros(4)))
    with pytest.raises(ValueError, match="user 'ann'.*give a tuple of tensors"):
        Examples.of("not data", user="ann")
    with pytest.raises(ValueError, match="no examples"):
        Examples.of(torch.utils.data.TensorDataset(torch.zeros(0, 2)), user="bob")


def test_users_split_by_a_user_column_keeps_every_example_once():
    x, y = torch.arange(10.0).reshape(10, 1), torch.arange(10)
    owner = ["b", "a", "b", "c", "a", "a", "c", "b", "a", "c"]
    users = Users.split((x, y), owner)
    assert users.ids == ("a", "b", "c")
    assert users[0].fields[1].tolist() == [1, 4, 5, 8] and users[1].fields[1].tolist() == [0, 2, 7]
    assert sorted(torch.cat([users[i].fields[1] for i in range(3)]).tolist()) == list(range(10))
    with pytest.raises(ValueError, match="shape"):
        Users.split((x, y), owner[:5])


def test_users_load_lazily_and_name_the_user_in_errors():
    loaded = []

    def load(uid):
        loaded.append(uid)
        return (torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)) if uid != "empty" else (torch.zeros(0, 3), torch.zeros(0))

    users = Users(["x", "y", "empty"], load)
    assert loaded == [] and users.num_users == 3
    assert len(users[1]) == 2 and loaded == ["y"]
    with pytest.raises(ValueError, match="user 'empty' has no examples"):
        users[2]
    broken = Users(3, lambda uid: 1 / 0)
    with pytest.raises(ValueError, match="loading the examples of user 1 failed: ZeroDivisionError"):
        broken[1]
    with pytest.raises(ValueError, match="distinct"):
        Users(["a", "a"], load)


def test_a_population_of_100000_users_on_disk_trains_loading_only_the_sampled_ones():
    """N = 100,000 lazily loaded users: the engine loads a user only when it is sampled (here ≈ 5 per round),
    never the population."""
    loads = []

    def load(uid: int):
        loads.append(uid)
        g = torch.Generator().manual_seed(uid)
        return torch.randn(3, 4, generator=g), torch.randint(0, 2, (3,), generator=g)

    task = Task(model=lambda: nn.Linear(4, 2), users=Users(100_000, load), loss=losses.classification, name="lazy")
    privacy = PrivacyConfig(expected_cohort=5, rounds=3, noise_multiplier=1.0, delta=1e-6, accountant="rdp")
    result = train(task, privacy, "dp-sgd", LocalTraining(batch_size=3), seed=0, eval_every=0)
    assert result.privacy.num_users == 100_000
    sampled = sum(r["nonprivate_cohort_size"] for r in result.records)
    assert len(loads) == sampled < 100  # one load per sampled user and round, nothing else
    assert math.isfinite(result.records[-1]["nonprivate_train_loss"])


def test_task_checks_what_it_is_given():
    users = Users.in_memory([(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))])
    with pytest.raises(ValueError, match="factory"):
        Task(model=nn.Linear(2, 2), users=users, loss=losses.classification)
    with pytest.raises(ValueError, match="Users"):
        Task(model=lambda: nn.Linear(2, 2), users=[(torch.zeros(1, 2), torch.zeros(1))], loss=losses.classification)
    with pytest.raises(ValueError, match="loss"):
        Task(model=lambda: nn.Linear(2, 2), users=users, loss="cross-entropy")
    with pytest.raises(ValueError, match="returned a str"):
        Task(model=lambda: "net", users=users, loss=losses.classification).build_model()
    with pytest.raises(ValueError, match="no parameters"):
        Task(model=nn.ReLU, users=users, loss=losses.classification).build_model()


def test_the_losses_check_targets_and_outputs():
    x = torch.randn(4, 3)
    linear = nn.Linear(3, 5)
    assert losses.classification(linear, (x, torch.tensor([0, 1, 2, 3]))).ndim == 0
    with pytest.raises(ValueError, match="regression target.*fed_dp.losses.regression"):
        losses.classification(linear, (x, torch.randn(4)))
    with pytest.raises(ValueError, match="do not fit the classification loss"):
        losses.classification(lambda inputs: torch.zeros(4, 5, 2), (x, torch.tensor([0, 1, 2, 3])))
    regression = nn.Linear(3, 1)
    y = torch.randn(4)
    assert float(losses.regression(regression, (x, y))) == pytest.approx(float(((regression(x).squeeze(-1) - y) ** 2).mean()))
    with pytest.raises(ValueError, match="class labels"):
        losses.regression(regression, (x, torch.tensor([0, 1, 2, 3])))
    with pytest.raises(ValueError, match="broadcasting"):
        losses.regression(nn.Linear(3, 2), (x, y))
    tokens = torch.randint(0, 7, (2, 6))
    lm = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7))
    expected = nn.functional.cross_entropy(lm(tokens[:, :-1]).reshape(-1, 7), tokens[:, 1:].reshape(-1))
    assert float(losses.next_token(lm, (tokens,))) == pytest.approx(float(expected))
    with pytest.raises(ValueError, match="integer tokens"):
        losses.next_token(lm, (tokens.float(),))
    with pytest.raises(ValueError, match="pairs? of tensors|\\(inputs, targets\\)"):
        losses.classification(linear, (x,))


def test_task_references_load_with_clear_errors():
    task = load_task("fed_dp.simulations.tasks.builtin:heavy_tail_task", {"users": 10})
    assert isinstance(task, Task) and task.num_users == 10
    with pytest.raises(ValueError, match="package.module:factory"):
        load_task("heavy_tail_task")
    with pytest.raises(ValueError, match="does not import"):
        load_task("nowhere_to_be_found:make")
    with pytest.raises(ValueError, match="returned a W1CNN; it must return a fed_dp.Task"):
        load_task("fed_dp.simulations.tasks.models:w1_cnn")


def test_held_out_evaluation_weights_batches_by_their_size():
    """The mean over 7 examples in batches of 3, 3, 1 equals the loss of all 7 at once (the last, short batch
    counts for one example, not for a third of the total)."""
    from fed_dp.clients import evaluation

    x, y = torch.randn(7, 3), torch.randn(7)
    model = nn.Linear(3, 1)
    metrics = evaluation.held_out((x, y), losses.regression, batch_size=3)(model)
    with torch.no_grad():
        assert metrics["eval_loss"] == pytest.approx(float(losses.regression(model, (x, y))), rel=1e-6)
    tokens = torch.randint(0, 5, (4, 6))
    lm = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5))
    with torch.no_grad():
        result = evaluation.held_out((tokens,), losses.next_token, perplexity=True)(lm)
    assert result["eval_perplexity"] == pytest.approx(math.exp(result["eval_loss"]))


def _as_moved_one_by_one(users: Users, device: str) -> list[Examples]:
    return [users.in_memory_examples[i].to(device) for i in range(len(users))]


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_users_of_one_structure_move_to_a_device_as_one_tensor_per_field(device):
    # Alike users travel together (one copy per field) and come back as views of it, in the shapes, dtypes and keys
    # (and on CUDA the values) of a move one user at a time; users of different structures still move one by one.
    torch.manual_seed(0)
    alike = Users.in_memory([{"x": torch.randn(n, 3, 4, 4), "y": torch.arange(n)} for n in (1, 3, 2)])
    mixed = Users.in_memory([(torch.randn(2, 3),), (torch.randn(2, 5),)])
    for users in (alike, mixed):
        moved = [users.to(device)[i] for i in range(len(users))]
        for got, want in zip(moved, _as_moved_one_by_one(users, device)):
            assert got.keys == want.keys
            for g, w in zip(got.fields, want.fields):
                assert (g.shape, g.dtype, g.device, g.stride()) == (w.shape, w.dtype, w.device, w.stride())
                if device == "cuda":
                    assert torch.equal(g.cpu(), w.cpu())
    moved_alike, moved_mixed = alike.to(device), mixed.to(device)
    together = [moved_alike[i].fields[0] for i in range(3)]
    assert together[0]._base is not None and all(t._base is together[0]._base for t in together)
    assert all(moved_mixed[i].fields[0]._base is None for i in range(2))
