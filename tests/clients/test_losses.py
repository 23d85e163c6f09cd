"""Losses whose batches carry more than (inputs, labels): masked next-token and multi-label."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from fed_dp.clients import evaluation, losses


class Bigram(nn.Module):
    def __init__(self, vocabulary: int = 7):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocabulary, vocabulary))

    def forward(self, tokens):
        return self.table[tokens]


def test_masked_next_token_is_the_mean_over_scored_targets_only():
    torch.manual_seed(0)
    model = Bigram().requires_grad_(False)
    tokens = torch.tensor([[1, 2, 3, 4], [4, 5, 6, 0]])
    mask = torch.tensor([[0.0, 0, 1, 1], [0.0, 1, 1, 0]])
    expected = [F.cross_entropy(model.table[tokens[b, j - 1]].unsqueeze(0), tokens[b, j].unsqueeze(0))
                for b, j in ((0, 2), (0, 3), (1, 1), (1, 2))]
    assert float(losses.next_token(model, (tokens, mask))) == pytest.approx(float(torch.stack(expected).mean()))
    ones = torch.ones_like(mask)
    assert float(losses.next_token(model, (tokens, ones))) == pytest.approx(float(losses.next_token(model, (tokens,))))
    assert float(losses.next_token(model, (tokens, torch.zeros_like(mask)))) == 0.0  # nothing scored
    with pytest.raises(ValueError, match="mask"):
        losses.next_token(model, (tokens, mask.long()))
    metrics = evaluation.next_token((tokens, mask))(model)
    assert metrics["eval_loss"] == pytest.approx(float(torch.stack(expected).mean()), rel=1e-6)
    predicted = model.table.argmax(1)
    hits = [int(predicted[tokens[b, j - 1]] == tokens[b, j]) for b, j in ((0, 2), (0, 3), (1, 1), (1, 2))]
    assert metrics["eval_accuracy"] == pytest.approx(sum(hits) / 4)


def test_masked_next_token_vectorizes_over_users():
    torch.manual_seed(1)
    model = Bigram()
    params = {k: v.detach() for k, v in model.named_parameters()}
    tokens = torch.randint(1, 7, (3, 2, 5))
    mask = (torch.rand(3, 2, 5) > 0.3).float()

    def loss(p, t, m):
        return losses.next_token(lambda x: functional_call(model, p, (x,)), (t, m))

    per_user = vmap(grad(loss), in_dims=(None, 0, 0))(params, tokens, mask)
    for u in range(3):
        model.zero_grad()
        losses.next_token(model, (tokens[u], mask[u])).backward()
        torch.testing.assert_close(per_user["table"][u], model.table.grad)


def test_multi_label_loss_and_metrics():
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]))
        model.bias.zero_()
    x = torch.tensor([[2.0, -1, 0], [-2.0, 3, 0], [1.0, 1, 0]])
    y = torch.tensor([[1.0, 0], [0, 0], [1, 1]])
    assert float(losses.multi_label(model, (x, y))) == pytest.approx(float(F.binary_cross_entropy_with_logits(model(x), y)))
    metrics = evaluation.multi_label((x, y))(model)
    # predicted: [1,0], [0,1], [1,1] → true positives 3 of 4 predicted, 3 of 3 true
    assert metrics["eval_precision"] == pytest.approx(0.75) and metrics["eval_recall"] == pytest.approx(1.0)
    assert metrics["eval_f1"] == pytest.approx(2 * 0.75 / 1.75)
    with pytest.raises(ValueError, match="multi-hot"):
        losses.multi_label(model, (x, y.long()))
