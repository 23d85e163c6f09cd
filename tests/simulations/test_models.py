"""Model shapes, parameter counts from the layer shapes, no BatchNorm, and per-example grads under vmap."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fed_dp.simulations.tasks.models import (MODELS, barcode_cnn, bigram_lm, cifar_cnn, linear_softmax, logistic_1d, pair_classifier,
                                      small_cnn, token_lm, w1_cnn)


def _conv(cin: int, cout: int, k: int) -> int:
    return cout * cin * k * k + cout


def _linear(fin: int, fout: int, bias: bool = True) -> int:
    return fout * fin + (fout if bias else 0)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# (factory, input shape, number of classes, parameter count computed from the layer shapes)
CASES = {
    "linear_softmax": (lambda: linear_softmax(20, 7), (20,), 7, _linear(20, 7, bias=False)),
    "logistic_1d": (logistic_1d, (1,), 2, 1),
    "cifar_cnn": (cifar_cnn, (3, 32, 32), 10,
                  _conv(3, 32, 3) + _conv(32, 64, 3) + _conv(64, 128, 3) + _conv(128, 256, 3) + _conv(256, 10, 3)),
    "barcode_cnn": (lambda: barcode_cnn(330), (28, 28), 330,
                    _conv(1, 16, 8) + _conv(16, 32, 4) + _linear(32 * 4 * 4, 32) + _linear(32, 330)),
    "w1_cnn": (w1_cnn, (3, 32, 32), 10, _conv(3, 16, 3) + _conv(16, 32, 3) + _linear(32 * 8 * 8, 10)),
    "small_cnn": (lambda: small_cnn(62), (1, 28, 28), 62, _conv(1, 16, 3) + _conv(16, 32, 3) + _linear(32 * 7 * 7, 62)),
}
# Text models take integer token ids: (factory, input shape, output shape after the batch, parameter count).
TEXT_CASES = {
    "pair_classifier": (lambda: pair_classifier(50, 3, 8, 6), (2, 7), (3,), 50 * 8 + _linear(32, 6) + _linear(6, 3)),
    "token_lm": (lambda: token_lm(50, 8, 2, 3), (7,), (7, 50), 50 * 8 + 50 + 2 * (3 * 8 * 8 + 8) + _linear(8, 8)),
    "bigram_lm": (lambda: bigram_lm(50, 6), (7,), (7, 50), 50 * 6 + 2 * 6 + _linear(6, 50)),
}


def test_registry_names_every_model():
    assert set(MODELS) == set(CASES) | set(TEXT_CASES)


@pytest.mark.parametrize("name", sorted(TEXT_CASES))
def test_text_models_shapes_counts_and_vmapped_gradients(name):
    """Output shape, parameter count from the layer shapes, padding ignored by the pair classifier, and
    per-example gradients under vmap equal to a loop (no data-dependent control flow)."""
    factory, shape, out_shape, params = TEXT_CASES[name]
    torch.manual_seed(0)
    model = factory()
    tokens = torch.randint(1, 50, (4, *shape))
    out = model(tokens)
    assert out.shape == (4, *out_shape) and _count(model) == params
    assert not [m for m in model.modules() if isinstance(m, (nn.modules.batchnorm._NormBase, nn.Dropout))]
    if name == "pair_classifier":
        padded = torch.cat([tokens, torch.zeros(4, 2, 5, dtype=torch.long)], dim=2)
        torch.testing.assert_close(model(padded), out)
    else:  # causal: the outputs at a position do not depend on later tokens
        changed = tokens.clone()
        changed[:, -1] = (changed[:, -1] % 49) + 1
        torch.testing.assert_close(model(changed)[:, :-1], out[:, :-1])
    named = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, t):
        return functional_call(model, p, (t.unsqueeze(0),)).square().mean()

    per_example = vmap(grad(loss), in_dims=(None, 0))(named, tokens)
    for i in range(4):
        model.zero_grad()
        model(tokens[i : i + 1]).square().mean().backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(per_example[k][i], p.grad, rtol=1e-4, atol=1e-6)


def test_documented_text_and_federated_model_sizes():
    assert _count(bigram_lm(10_000)) == 130_012
    assert _count(small_cnn(62)) == 102_078 and _count(small_cnn(17, 3, 32)) == 39_921
    assert _count(pair_classifier(10_000, 3)) == 656_643 and _count(token_lm(10_000)) == 687_056


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_shape_and_parameter_count(name):
    factory, shape, classes, params = CASES[name]
    torch.manual_seed(0)
    model = factory()
    out = model(torch.rand(5, *shape))
    assert out.shape == (5, classes)
    assert torch.isfinite(out).all()
    assert _count(model) == params


def test_documented_parameter_counts():
    assert _count(w1_cnn()) == 25_578  # W1 (docs/explanation/benchmarks.md)
    assert _count(cifar_cnn()) == 411_466
    assert _count(barcode_cnn(330)) == 36_570
    assert _count(linear_softmax(9216, 255)) == 9216 * 255


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_batch_norm_or_other_cross_example_layers(name):
    model = CASES[name][0]()
    banned = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.Dropout)
    assert not [m for m in model.modules() if isinstance(m, banned)]


def test_barcode_cnn_accepts_images_with_or_without_channel_dim():
    torch.manual_seed(0)
    model = barcode_cnn(12)
    x = torch.rand(3, 28, 28)
    torch.testing.assert_close(model(x), model(x.unsqueeze(1)))
    torch.testing.assert_close(model(x), model(x.reshape(3, 784)))


def test_logistic_1d_cross_entropy_is_the_logistic_loss_and_ignores_zero_inputs():
    model = logistic_1d(init=0.7)
    x = torch.tensor([[1.5], [-2.0], [0.0]])
    y = torch.tensor([1, 0, 1])
    loss = nn.functional.cross_entropy(model(x), y, reduction="none")
    p = torch.sigmoid(0.7 * x.squeeze(1))
    torch.testing.assert_close(loss, -(y * p.log() + (1 - y) * (1 - p).log()))
    # an example with x = 0 contributes exactly zero gradient (no bias parameter)
    model.zero_grad()
    nn.functional.cross_entropy(model(x[2:]), y[2:]).backward()
    assert model.linear.weight.grad.item() == 0.0
    assert logistic_1d().linear.weight.item() == 0.0


def test_linear_softmax_starts_at_uniform_loss():
    model = linear_softmax(6, 5)
    loss = nn.functional.cross_entropy(model(torch.rand(4, 6)), torch.tensor([0, 1, 2, 4]))
    assert loss.item() == pytest.approx(torch.log(torch.tensor(5.0)).item())
    with pytest.raises(ValueError, match="activation"):
        cifar_cnn(activation="swish")


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmapped_per_example_gradients_equal_a_loop(name):
    factory, shape, classes, _ = CASES[name]
    torch.manual_seed(1)
    model = factory()
    if name in ("linear_softmax", "logistic_1d"):  # zero-initialized: move off the symmetric start
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    params = {k: v.detach() for k, v in model.named_parameters()}
    n = 3
    x = torch.rand(n, *shape)
    y = torch.randint(0, classes, (n,))

    def loss(p, xi, yi):
        logits = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(n):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for k, p in model.named_parameters():
            assert per_example[k].shape == (n, *p.shape)
            torch.testing.assert_close(per_example[k][i], p.grad, rtol=1e-4, atol=1e-6)


def test_w1_forward_is_the_benchmark_network_conv_relu_pool():
    """W1CNN pools before its ReLU for speed; outputs and gradients equal the order of W1 as specified
    conv → ReLU → max-pool (computed here with the functional ops), on inputs with many negative windows."""
    torch.manual_seed(0)
    model = w1_cnn()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def specified(p):
        h = nn.functional.max_pool2d(torch.relu(nn.functional.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=1)), 2)
        h = nn.functional.max_pool2d(torch.relu(nn.functional.conv2d(h, p["conv2.weight"], p["conv2.bias"], padding=1)), 2)
        return nn.functional.linear(h.flatten(1), p["fc.weight"], p["fc.bias"])

    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    expected = specified(params)
    nn.functional.cross_entropy(expected, y).backward()
    out = model(x)
    nn.functional.cross_entropy(out, y).backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-5, atol=1e-7)
