"""The seed papers' models, as plain ``torch.nn`` modules (no BatchNorm: it mixes examples, which breaks
per-example / per-user clipping).

| name | used for | layers | parameters |
|---|---|---|---|
| ``linear_softmax(d, c)`` | seed 003 §3 heavy-tail synthetic | W x, W ∈ R^{c×d}, no bias | c·d |
| ``logistic_1d()`` | seed 000 §5.1 sparse 1-D logistic regression | logits (0, w x) | 1 |
| ``cifar_cnn()`` | seeds 001/004, CIFAR-10 "5-layer CNN" | 5 conv (tanh), global average pool | 411,466 |
| ``barcode_cnn(c)`` | seed 003 App. B, Barcode-MNIST "2-convolution-layer CNN" | 2 conv + 2 linear (tanh) | 25,680 + 33·c |
| ``w1_cnn()`` | W1 (docs/explanation/benchmarks.md) throughput workload | 2 conv (ReLU) + linear | 25,578 |
| ``small_cnn(c, channels, size)`` | FEMNIST (1×28×28, c = 62), FLAIR (3×32×32, 17 labels) | the W1 CNN's layers | 5,088 + (32·(size/4)² + 1)·c + 144·(channels − 3) |
| ``pair_classifier(V, c)`` | SNLI, QNLI sentence pairs | mean word embeddings of both sentences, [u, v, ∣u−v∣, u·v], MLP | V·e + 4e·h + h + h·c + c |
| ``token_lm(V)`` | PTB, E2E, Shakespeare, StackOverflow next-token prediction | embeddings, causal convolutions + running mean, tied output | V·e + V + l·(k·e² + e) + e² + e |
| ``bigram_lm(V)`` | the ``small-users`` benchmark's StackOverflow-shaped population | embedding, LayerNorm, linear | V·e + 2e + e·V + V |

Text models (``pair_classifier``, ``token_lm``) take integer token ids with ``<pad>`` = 0 and mask padding by
arithmetic, not by branching, so they vectorize over users with ``torch.func`` like the others.

The image models map a batch ``x`` (N, ...) to logits (N, classes), so ``nn.functional.cross_entropy`` is
the loss everywhere, and every model works under ``torch.func.functional_call`` + ``vmap`` + ``grad``
(per-example or per-user gradients). Initialization is PyTorch's default unless stated; callers seed
it (``torch.manual_seed``) before calling a factory.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = [
    "MODELS",
    "BarcodeCNN",
    "CifarCNN5",
    "LinearSoftmax",
    "Logistic1D",
    "PairClassifier",
    "TokenLM",
    "BigramLM",
    "W1CNN",
    "barcode_cnn",
    "bigram_lm",
    "cifar_cnn",
    "linear_softmax",
    "logistic_1d",
    "pair_classifier",
    "small_cnn",
    "token_lm",
    "w1_cnn",
]

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


def _activation(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]()


class LinearSoftmax(nn.Module):
    """Logits ``W x`` (x flattened), W ∈ R^{c×d}; softmax cross-entropy gives seed 003's loss."""

    def __init__(self, in_features: int, num_classes: int, *, bias: bool = False, zero_init: bool = True):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes, bias=bias)
        if zero_init:
            nn.init.zeros_(self.linear.weight)
            if bias:
                nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


def linear_softmax(in_features: int, num_classes: int, *, bias: bool = False, zero_init: bool = True) -> LinearSoftmax:
    """Seed 003 §3: "a linear model with weights W ∈ R^{c×d} to minimize ℓ(W, x, y) = −log(s(Wx)_y)".

    No bias (the seed's model is Wx; ``bias=True`` adds one). Zero initialization by default: every
    class then starts at loss log c, the starting point of the per-frequency-group loss curves, and the
    convex problem needs no random symmetry breaking. Parameters: c·d (+ c with bias).
    """
    return LinearSoftmax(in_features, num_classes, bias=bias, zero_init=zero_init)


class Logistic1D(nn.Module):
    """One weight w; logits ``(0, w·x)`` so that softmax cross-entropy is the logistic loss."""

    def __init__(self, init: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(1, 1, bias=False)
        nn.init.constant_(self.linear.weight, init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.linear(x.reshape(-1, 1))
        return torch.cat([torch.zeros_like(z), z], dim=1)


def logistic_1d(init: float = 0.0) -> Logistic1D:
    """Seed 000 §5.1 1-D logistic regression: one parameter w, no bias; p(y = 1 | x) = σ(w x).

    No bias because the seed's sparse setting relies on examples with x = 0 having gradient exactly 0
    (a bias would receive a gradient from them). The model outputs the two-class logits (0, w x):
    ``cross_entropy((0, wx), y)`` = −y log σ(wx) − (1 − y) log(1 − σ(wx)), the logistic loss, so the
    same loss function serves every task. Input x of shape (N,) or (N, 1); w starts at ``init`` (0).
    """
    return Logistic1D(init)


class CifarCNN5(nn.Module):
    """Tang & Lécuyer's 5-layer CNN for CIFAR-10 (see :func:`cifar_cnn`)."""

    def __init__(self, num_classes: int = 10, activation: str = "tanh"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3)  # 32×32 → 30×30 ("VALID")
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)  # "SAME" from here on
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.conv4 = nn.Conv2d(128, 256, 3, padding=1)
        self.conv5 = nn.Conv2d(256, num_classes, 3, padding=1)
        self.act = _activation(activation)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act(self.conv1(x)))  # 15×15
        x = self.pool(self.act(self.conv2(x)))  # 7×7
        x = self.pool(self.act(self.conv3(x)))  # 3×3
        x = self.act(self.conv4(x))
        return self.conv5(x).mean(dim=(-2, -1))  # global average pool → (N, classes)


def cifar_cnn(num_classes: int = 10, activation: str = "tanh") -> CifarCNN5:
    """The "5-layer CNN" of seeds 001 (Tang & Lécuyer, DP-AdamBC, §5) and 004 (DP-AdamW, App. C.1).

    The seeds say only "a 5-layer CNN model and all of the model parameters are initialized randomly"
    (001) and "the same CNN architecture" as Tang & Lécuyer (004). The layers are those of the seed-001
    authors' public implementation (``CNN5``, run on CIFAR-10 with ``--activation tanh``), no
    normalization layer:

    ====================================================  ==========  ===========
    layer                                                  output      parameters
    ====================================================  ==========  ===========
    conv 3→32, 3×3, no padding; tanh; max-pool 2           32×15×15        896
    conv 32→64, 3×3, pad 1; tanh; max-pool 2               64×7×7       18,496
    conv 64→128, 3×3, pad 1; tanh; max-pool 2              128×3×3      73,856
    conv 128→256, 3×3, pad 1; tanh                         256×3×3     295,168
    conv 256→10, 3×3, pad 1; global average pool → logits  10           23,050
    ====================================================  ==========  ===========

    Total 411,466 parameters for 10 classes. Input (N, 3, 32, 32). ``activation="relu"`` swaps tanh.
    """
    return CifarCNN5(num_classes, activation)


class BarcodeCNN(nn.Module):
    """Two-convolution DP CNN for 28×28 grey images (see :func:`barcode_cnn`)."""

    def __init__(self, num_classes: int, activation: str = "tanh"):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, stride=2)  # 28 → 11
        self.conv2 = nn.Conv2d(16, 32, 4, stride=2, padding=1)  # 10 → 5
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, num_classes)
        self.act = _activation(activation)
        self.pool = nn.MaxPool2d(2, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, 1, 28, 28)  # accepts (N, 28, 28), (N, 1, 28, 28) or (N, 784)
        x = self.pool(self.act(self.conv1(x)))  # 16×10×10
        x = self.pool(self.act(self.conv2(x)))  # 32×4×4
        x = self.act(self.fc1(x.flatten(1)))
        return self.fc2(x)


def barcode_cnn(num_classes: int, activation: str = "tanh") -> BarcodeCNN:
    """The "2-convolution-layer CNN" of seed 003 App. B for Barcode-MNIST.

    The seed gives only "We train the dataset with a 2-convolution-layer CNN model". Its authors'
    group's public code (Tang & Lécuyer, DP-AdamBC) has one 2-convolution CNN, ``CNN2`` — the standard DP
    MNIST CNN (as in Papernot et al. 2021's tempered-sigmoid experiments) — used here, with tanh:

    ===================================================  ========  ==============
    layer                                                 output    parameters
    ===================================================  ========  ==============
    conv 1→16, 8×8, stride 2; tanh; max-pool 2, stride 1   16×10×10  1,040
    conv 16→32, 4×4, stride 2, pad 1; tanh; max-pool 2/1   32×4×4    8,224
    linear 512→32; tanh                                    32        16,416
    linear 32→c (logits)                                   c         33·c
    ===================================================  ========  ==============

    Total 25,680 + 33·c parameters (36,570 for c = 330). Input (N, 28, 28), (N, 1, 28, 28) or (N, 784).
    (Kunstner et al. 2024's own barcoded-MNIST CNN, conv 32 5×5 → conv 100 5×5 → linear, is the other
    reading; it has ≈1.7 M parameters at c = 330, large for DP training.)
    """
    return BarcodeCNN(num_classes, activation)


class W1CNN(nn.Module):
    """W1 (docs/explanation/benchmarks.md) model (see :func:`w1_cnn`); other input sizes and channels: :func:`small_cnn`."""

    def __init__(self, num_classes: int = 10, channels: int = 3, size: int = 32):
        super().__init__()
        if size % 4:
            raise ValueError(f"the image size must be divisible by 4 (two 2x2 poolings), got {size}")
        self.channels, self.size = channels, size
        self.conv1 = nn.Conv2d(channels, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * (size // 4) ** 2, num_classes)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, self.channels, self.size, self.size)
        # ReLU(max-pool(z)) = max-pool(ReLU(z)) (ReLU is monotone), with the same gradient: a window whose
        # max is ≤ 0 gets none either way. Pooling first applies ReLU to 4× fewer values (20–25% faster
        # training on the 2-core CPUs here); tests/simulations/test_models.py checks the equality.
        x = torch.relu(self.pool(self.conv1(x)))  # 16×16×16
        x = torch.relu(self.pool(self.conv2(x)))  # 32×8×8
        return self.fc(x.flatten(1))


def w1_cnn(num_classes: int = 10) -> W1CNN:
    """W1 (docs/explanation/benchmarks.md): conv(3→16, 3×3, pad 1) → ReLU → max-pool 2 → conv(16→32, 3×3, pad 1) → ReLU →
    max-pool 2 → linear(32·8·8 → 10). Parameters 448 + 4,640 + 20,490 = 25,578. Input (N, 3, 32, 32)."""
    return W1CNN(num_classes)


def small_cnn(num_classes: int, channels: int = 1, size: int = 28) -> W1CNN:
    """The W1 CNN's layers for ``channels``×``size``×``size`` images: conv(channels→16, 3×3) → max-pool 2 →
    ReLU → conv(16→32, 3×3) → max-pool 2 → ReLU → linear(32·(size/4)² → classes). FEMNIST (LEAF's 28×28
    grey digits and letters, 62 classes; LEAF's own CNN has 6.6 M parameters, too many for 2 CPU cores):
    160 + 4,640 + 97,278 = 102,078 parameters. FLAIR at 32×32 (17 labels): 448 + 4,640 + 34,833 = 39,921.
    Inputs may come flat ((N, channels·size²), as LEAF stores them)."""
    return W1CNN(num_classes, channels, size)


class PairClassifier(nn.Module):
    """Sentence-pair classifier (see :func:`pair_classifier`)."""

    def __init__(self, vocab_size: int, num_classes: int, embedding: int = 64, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding)
        self.hidden = nn.Linear(4 * embedding, hidden)
        self.out = nn.Linear(hidden, num_classes)

    def _sentence(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != 0).to(self.embed.weight.dtype).unsqueeze(-1)  # <pad> = 0 contributes nothing
        return (self.embed(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:  # (N, 2, L) token ids → (N, classes)
        u, v = self._sentence(pairs[:, 0]), self._sentence(pairs[:, 1])
        features = torch.cat([u, v, (u - v).abs(), u * v], dim=1)
        return self.out(torch.tanh(self.hidden(features)))


def pair_classifier(vocab_size: int, num_classes: int, embedding: int = 64, hidden: int = 64) -> PairClassifier:
    """SNLI / QNLI sentence-pair classifier trained from scratch (the seeds fine-tune BERT, which is neither
    small nor available offline): each sentence is the mean of its word embeddings (u, v); the features
    [u, v, |u − v|, u ⊙ v] (Conneau et al. 2017's pair features) go through tanh(linear) and a linear
    layer to the logits. Input (N, 2, L) token ids, ``<pad>`` = 0. Parameters: V·e + (4e·h + h) + (h·c + c)
    (V = 10,000, e = h = 64, c = 3: 656,643)."""
    return PairClassifier(vocab_size, num_classes, embedding, hidden)


class TokenLM(nn.Module):
    """Causal next-token model (see :func:`token_lm`)."""

    def __init__(self, vocab_size: int, embedding: int = 64, layers: int = 2, context: int = 4):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, embedding)
        nn.init.normal_(self.embed.weight, std=embedding**-0.5)  # tied output: logits of order 1 at the start
        self.convs = nn.ModuleList(nn.Conv1d(embedding, embedding, context) for _ in range(layers))
        self.summary = nn.Linear(embedding, embedding)
        self.out_bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (N, L) → (N, L, V)
        e = self.embed(tokens)  # (N, L, e)
        positions = torch.arange(1, tokens.shape[1] + 1, dtype=e.dtype, device=e.device).reshape(1, -1, 1)
        h = e + torch.tanh(self.summary(e.cumsum(1) / positions))  # running mean: everything so far
        h = h.transpose(1, 2)
        for conv in self.convs:
            h = h + torch.tanh(conv(nn.functional.pad(h, (self.context - 1, 0))))  # sees the last `context`
        return nn.functional.linear(h.transpose(1, 2), self.embed.weight, self.out_bias)


def token_lm(vocab_size: int, embedding: int = 64, layers: int = 2, context: int = 4) -> TokenLM:
    """A small causal next-token model for 2 CPU cores (the seeds fine-tune GPT-2, which is neither): token
    embeddings plus tanh(linear(running mean of the embeddings so far)) (the whole prefix: the meaning
    representation of an E2E prompt), then ``layers`` residual tanh causal convolutions over the last
    ``context`` positions, and logits = h·Eᵀ + b with the embedding matrix E tied to the output (E is
    initialized N(0, 1/e) so that the first logits are of order 1).
    No recurrence and no attention mask built from the data, so it vectorizes over users. Parameters:
    V·e + V + layers·(context·e² + e) + e² + e (V = 10,000, e = 64, 2 layers, context 4: 687,056)."""
    return TokenLM(vocab_size, embedding, layers, context)


class BigramLM(nn.Module):
    """Next-token logits from the current token alone (see :func:`bigram_lm`)."""

    def __init__(self, vocab_size: int, embedding: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embedding)
        self.norm = nn.LayerNorm(embedding)
        self.out = nn.Linear(embedding, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (N, L) → (N, L, V)
        return self.out(self.norm(self.embed(tokens)))


def bigram_lm(vocab_size: int, embedding: int = 6) -> BigramLM:
    """The smallest next-token model of the layers a per-user fast path handles (Embedding, LayerNorm,
    Linear; no recurrence, no attention): logits(t) = W·LayerNorm(E[token t]) + b, a bigram model of rank e.
    Parameters: V·e + 2e + e·V + V (V = 10,000, e = 6: 130,012, the size of the StackOverflow-shaped
    population of the ``small-users`` benchmark, ``benchmark.small_users``)."""
    return BigramLM(vocab_size, embedding)


#: Model factories by name; each returns a freshly initialized module.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "linear_softmax": linear_softmax,
    "logistic_1d": logistic_1d,
    "cifar_cnn": cifar_cnn,
    "barcode_cnn": barcode_cnn,
    "w1_cnn": w1_cnn,
    "small_cnn": small_cnn,
    "pair_classifier": pair_classifier,
    "token_lm": token_lm,
    "bigram_lm": bigram_lm,
}
