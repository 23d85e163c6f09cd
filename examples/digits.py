"""Your own model, data and loss with fed-dp: an MLP on scikit-learn's handwritten digits, split into 100 users,
trained with DP-AdamBC at user-level epsilon = 3 (delta = 1e-5).   python examples/digits.py"""

import torch
from sklearn.datasets import load_digits
from torch import nn

import fed_dp
from fed_dp import LocalTraining, PrivacyConfig, Task, Users, evaluation, losses


def make_task(users: int = 100, seed: int = 0) -> Task:
    """1,797 digit images (8x8): 300 held out for evaluation, the rest dealt to `users` users."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:300], order[300:]
    return Task(
        model=lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)),
        users=Users.split((x[train], y[train]), torch.arange(len(train)) % users),  # user of each example
        loss=losses.classification,
        evaluate=evaluation.classification((x[test], y[test])),
        name="digits",
    )


def main(users: int = 100, rounds: int = 100, seed: int = 0) -> fed_dp.TrainResult:
    privacy = PrivacyConfig(expected_cohort=users // 2, rounds=rounds, target_epsilon=3.0, delta=1e-5)
    result = fed_dp.train(make_task(users, seed), privacy, fed_dp.make_optimizer("dp-adambc", lr=0.02),
                          LocalTraining(epochs=2, batch_size=8, lr=0.2), seed=seed)
    print(f"user-level epsilon {result.epsilon:.3f} at delta {result.delta:g} "
          f"(sigma {result.privacy.noise_multiplier:.3f}), test accuracy {result.records[-1]['eval_accuracy']:.3f}")
    return result


if __name__ == "__main__":
    main()
