"""Built-in tasks: every task builds from its data (local files in the real formats) into disjoint users, as
an ordinary fed_dp.Task loaded by reference (task.ref)."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch

from fed_dp.clients.task import load_task
from fed_dp.run_config import registered_tasks
from fed_dp.simulations.tasks.builtin import label_counts
from fed_dp.simulations.tasks.synthetic import heavy_tail_class_sizes


def build_task(name: str, **options):
    return load_task(registered_tasks().get(name, name), options)


def _examples(task, field: int) -> torch.Tensor:
    return torch.cat([task.users[i].fields[field] for i in range(task.num_users)])


def _write_cifar(root, rows_per_batch: int = 20, seed: int = 0) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (rows_per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, rows_per_batch).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))


def _write_mnist(root, per_digit: int = 30, seed: int = 0) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for prefix, n_per in (("train", per_digit), ("t10k", 2)):
        labels = np.repeat(np.arange(10, dtype=np.uint8), n_per)
        images = rng.integers(0, 256, (labels.size, 28, 28), dtype=np.uint8)
        (root / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, labels.size, 28, 28) + images.tobytes())
        (root / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, labels.size) + labels.tobytes())


def _assert_users_partition(task, total: int) -> None:
    sizes = [len(task.users[i]) for i in range(task.num_users)]
    assert task.num_users == len(task.users) and min(sizes) >= 1
    assert sum(sizes) == total


def test_heavy_tail_task_keeps_exact_class_sizes_and_groups():
    task = build_task("heavy-tail", groups=3, largest=8, users=12, seed=1)
    sizes = heavy_tail_class_sizes(groups=3, largest=8)
    assert np.array_equal(label_counts(task, 7), sizes.numpy())
    _assert_users_partition(task, int(sizes.sum()))
    assert task.class_groups.tolist() == [0, 1, 1, 2, 2, 2, 2]
    # a memorization task: evaluated on its own examples — a model that predicts every label right scores 1
    x, y = _examples(task, 0), _examples(task, 1)

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, inputs):
            rows = [int(torch.nonzero((x == row).all(dim=1))[0]) for row in inputs]
            return torch.nn.functional.one_hot(y[rows], 7).float() * 10

    metrics = task.evaluate(Oracle())
    assert metrics["eval_accuracy"] == 1.0 and all(metrics[f"group{g}_accuracy"] == 1.0 for g in range(3))


def test_cifar10_task_from_local_batches(tmp_path):
    _write_cifar(tmp_path)
    task = build_task("cifar10", root=str(tmp_path), users=10, partition="iid", seed=0)
    _assert_users_partition(task, 100)
    assert task.users[0].fields[0].shape[1:] == (3, 32, 32)
    assert 0 <= task.evaluate(task.build_model())["eval_accuracy"] <= 1  # the 20 test images
    assert task.build_model()(task.users[0].fields[0]).shape[1] == 10


def test_barcode_mnist_task_from_local_idx_files(tmp_path):
    _write_mnist(tmp_path / "mnist")
    task = build_task("barcode-mnist", root=str(tmp_path / "mnist"), users=8, groups=[[1, 12], [2, 3]],
                      eval_fraction=0.25, seed=0)
    # 10 plain digits × 12 examples + 20 barcoded classes × 3 examples = 180; a quarter held out
    assert task.class_groups.bincount().tolist() == [10, 20]
    _assert_users_partition(task, 180 - 45)
    assert {"group0_accuracy", "group1_accuracy"} <= set(task.evaluate(task.build_model()))
    assert task.build_model()(task.users[0].fields[0]).shape[1] == 30


def test_missing_data_folder_says_what_to_put_where(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        build_task("cifar10", root=str(tmp_path / "nowhere"), users=2)


def test_every_built_in_task_name_is_a_factory_of_the_tasks_package():
    """The tasks package owns the table of short names (pyproject.toml's entry-point group fed_dp.tasks); the
    core reads it from the installed metadata. Every name loads to a factory of ``tasks.builtin``."""
    from fed_dp.simulations.tasks import builtin, hf

    ours = {name: target for name, target in registered_tasks().items() if target.startswith("fed_dp.")}
    assert len(ours) == 20
    for name, target in ours.items():
        module, _, factory = target.partition(":")
        owner = hf if name.startswith("hf-") else builtin  # hf-*: the Hugging Face tasks (the optional hf part)
        assert module == owner.__name__ and callable(getattr(owner, factory)), name


def test_unknown_task_or_parameter_is_a_clear_error():
    with pytest.raises(ValueError, match="does not import"):
        build_task("no_such_package.tasks:imagenet")
    with pytest.raises(ValueError, match="has no attribute"):
        build_task("fed_dp.simulations.tasks.builtin:imagenet")
    with pytest.raises(ValueError, match="does not take colour; it takes groups"):
        build_task("heavy-tail", colour=3)


def test_sparse_task_has_held_out_data_of_the_same_law():
    task = build_task("sparse-logreg-1d", num_examples=200, users=50, seed=3)
    _assert_users_partition(task, 200)
    from fed_dp.simulations.tasks.synthetic import sparse_logistic_1d

    x_eval, y_eval = sparse_logistic_1d(num_examples=200, seed=4)  # held out: the next seed, same law
    model = task.build_model()
    with torch.no_grad():
        model.linear.weight.fill_(0.7)
        expected = torch.nn.functional.cross_entropy(model(x_eval), y_eval)
    assert task.evaluate(model)["eval_loss"] == pytest.approx(float(expected))
    x_train, _ = sparse_logistic_1d(num_examples=200, seed=3)
    assert sorted(_examples(task, 0).flatten().tolist()) == sorted(x_train.flatten().tolist())


def test_w1_task_is_benchmarks_md_w1():
    """500 users × 32 CIFAR-shaped examples, user i's drawn from torch.Generator().manual_seed(i) (inputs,
    then labels), the 25,578-parameter CNN, no held-out data; the same users whatever N is."""
    task = build_task("w1")
    assert task.num_users == 500 and all(len(task.users[i]) == 32 for i in range(500))
    assert sum(p.numel() for p in task.build_model().parameters()) == 25_578
    assert task.evaluate is None
    for user in (0, 7, 499):
        generator = torch.Generator().manual_seed(user)
        x = torch.randn(32, 3, 32, 32, generator=generator)
        y = torch.randint(10, (32,), generator=generator)
        assert torch.equal(task.users[user].fields[0], x) and torch.equal(task.users[user].fields[1], y)
    small = build_task("w1", users=8, examples=4)
    assert torch.equal(small.users[7].fields[0], task.users[7].fields[0][:4])
    assert not torch.equal(task.users[0].fields[0], task.users[1].fields[0])
    with pytest.raises(ValueError, match="users"):
        build_task("w1", users=0)


# ------------------------------------------------------------------ text and natural-user tasks on fixtures

import data_fixtures  # noqa: E402

from fed_dp.simulations.tasks import text  # noqa: E402

SPLIT_TASKS = ("snli", "qnli", "ptb", "e2e")  # dealt to users by a partitioner
NATURAL_TASKS = ("femnist", "shakespeare", "stackoverflow", "flair")  # users from the data


@pytest.mark.parametrize("name", SPLIT_TASKS + NATURAL_TASKS)
def test_text_and_federated_tasks_build_train_a_step_and_evaluate(name, tmp_path):
    root = data_fixtures.write(name, tmp_path / name)
    task = build_task(name, root=str(root), **({"users": 3} if name in SPLIT_TASKS else {}))
    model = task.build_model()
    batch = task.users[0].select(slice(0, 2))
    loss = task.loss(model, batch)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        metrics = task.evaluate(model)
    assert "eval_loss" in metrics and all(np.isfinite(v) for v in metrics.values())
    assert str(root) in task.description


def test_natural_users_are_the_datas_own(tmp_path):
    train, _ = data_fixtures.write_femnist(tmp_path / "femnist")
    task = build_task("femnist", root=str(tmp_path / "femnist"))
    assert task.users.ids == tuple(train) and task.num_users == 3
    for i, user in enumerate(train):
        x, y = task.users[i].fields
        assert y.tolist() == train[user][1]
        torch.testing.assert_close(x.reshape(len(y), -1), torch.tensor(train[user][0], dtype=torch.float32))
    assert build_task("femnist", root=str(tmp_path / "femnist"), max_users=2).users.ids == tuple(train)[:2]
    data_fixtures.write_stackoverflow(tmp_path / "so")
    so = build_task("stackoverflow", root=str(tmp_path / "so"))
    assert so.users.ids == tuple(sorted(data_fixtures.STACKOVERFLOW_CLIENTS))
    tokens, mask = so.users[0].fields
    vocabulary = so.info["vocabulary"]
    first = data_fixtures.STACKOVERFLOW_CLIENTS[so.users.ids[0]][0].split()
    assert vocabulary.decode(tokens[0, : len(first) + 2]) == ["<bos>", *first, "<eos>"]
    assert mask[0].sum() == len(first) + 1  # every word and <eos> is a target, padding is not


def test_ptb_users_predict_every_training_token_once(tmp_path):
    root = data_fixtures.write_ptb(tmp_path)
    task = build_task("ptb", root=str(root), users=2, length=8)
    targets = sum(float(task.users[i].fields[1][:, 1:].sum()) for i in range(2))
    sentences = [line.split() + ["<eos>"] for line in data_fixtures.PTB_LINES]
    assert targets == sum(len(s) for s in sentences) - 2  # each user's first token is not predicted
    assert sorted(w for w in task.info["vocabulary"].tokens if w not in text.SPECIALS) == \
        sorted({w for s in sentences for w in s} - set(text.SPECIALS))


def test_e2e_scores_only_the_reference(tmp_path):
    root = data_fixtures.write_e2e(tmp_path)
    task = build_task("e2e", root=str(root), users=1)
    tokens, mask = task.users[0].fields
    vocabulary = task.info["vocabulary"]
    for row, m in zip(tokens, mask):
        words = vocabulary.decode(row[row != 0])
        sep = words.index("<sep>")
        assert words[0] == "<bos>" and words[-1] == "<eos>"
        assert m.nonzero().flatten().tolist() == list(range(sep + 1, len(words)))
    decoded = [vocabulary.decode(row[row != 0]) for row in tokens]
    pairs = sorted((w[1 : w.index("<sep>")], w[w.index("<sep>") + 1 : -1]) for w in decoded)
    assert pairs == sorted((text.words(mr), text.words(ref)) for mr, ref in data_fixtures.E2E_ROWS)


@pytest.mark.parametrize("name", SPLIT_TASKS + NATURAL_TASKS)
def test_a_wrong_folder_is_a_clear_error(name, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as error:
        build_task(name, root=str(tmp_path / "empty"), **({"users": 3} if name in SPLIT_TASKS else {}))
    assert str(tmp_path / "empty") in str(error.value) and "Put" in str(error.value) or "Make it" in str(error.value)


def test_stackoverflow_like_population_loads_only_the_users_a_round_samples(monkeypatch):
    """342,477 users, none generated when the task is built; a round of the engine generates exactly its Poisson
    cohort, each user once; the model is the 130,012-weight bigram LM at V = 10,000."""
    from fed_dp import PrivacyConfig, train
    from fed_dp.config import LocalTraining
    from fed_dp.randomness import derive_seed
    from fed_dp.sampling import make_sampler
    from fed_dp.simulations.tasks import synthetic
    from fed_dp.simulations.tasks.builtin import stackoverflow_like_task

    loaded = []
    generate = synthetic.stackoverflow_like_user
    monkeypatch.setattr(synthetic, "stackoverflow_like_user", lambda uid, **kw: loaded.append(uid) or generate(uid, **kw))
    task = build_task("fed_dp.simulations.tasks.builtin:stackoverflow_like_task", vocabulary=40)
    assert task.num_users == 342_477 and loaded == []
    privacy = PrivacyConfig(num_users=task.num_users, expected_cohort=6, rounds=1, noise_multiplier=1.0, delta=1e-6,
                            accountant="rdp")
    train(task, privacy, "dp-fedavg", LocalTraining(steps=1, batch_size=64), seed=3, eval_every=0, device="cpu")
    cohort = make_sampler(privacy, seed=derive_seed(3, "sampler")).next_cohort().tolist()
    assert sorted(loaded) == sorted(cohort) and cohort
    assert torch.equal(task.users[5].fields[0], synthetic.stackoverflow_like_user(5, vocabulary=40)[0])
    assert sum(p.numel() for p in stackoverflow_like_task(users=3).build_model().parameters()) == 130_012
