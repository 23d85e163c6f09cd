"""A small next-token language model trained with user-level DP: each line of examples/data/corpus.txt is one
user's notes; every user's text is cut into windows of characters.   python examples/language_model.py"""

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import fed_dp
from fed_dp import LocalTraining, PrivacyConfig, Task, Users, evaluation, losses

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class CharLM(nn.Module):
    """Embedding → causal convolution over the last `context` characters → logits of the next one."""

    def __init__(self, vocabulary: int, width: int = 48, context: int = 4):
        super().__init__()
        self.embed, self.context = nn.Embedding(vocabulary, width), context
        self.conv, self.out = nn.Conv1d(width, width, context), nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (batch, length) → (batch, length, vocabulary)
        h = F.pad(self.embed(tokens).transpose(1, 2), (self.context - 1, 0))
        return self.out(torch.relu(self.conv(h)).transpose(1, 2))


def make_task(window: int = 16, held_out: int = 20) -> Task:
    lines = CORPUS.read_text().splitlines()
    alphabet = sorted(set("".join(lines)))
    encode = lambda text: torch.tensor([alphabet.index(c) for c in text])  # noqa: E731
    windows = lambda text: encode(text).unfold(0, window, window // 2)  # (examples, window) per text  # noqa: E731
    return Task(model=lambda: CharLM(len(alphabet)), users=Users.in_memory([(windows(t),) for t in lines[held_out:]]),
                loss=losses.next_token, name="char-lm",
                evaluate=evaluation.held_out((torch.cat([windows(t) for t in lines[:held_out]]),), losses.next_token,
                                             perplexity=True))


def main(rounds: int = 200, seed: int = 0) -> fed_dp.TrainResult:
    privacy = PrivacyConfig(expected_cohort=25, rounds=rounds, target_epsilon=8.0, delta=1e-3, accountant="rdp")
    result = fed_dp.train(make_task(), privacy, fed_dp.make_optimizer("dp-adam", lr=0.01),
                          LocalTraining(epochs=2, batch_size=4, lr=0.5), seed=seed, eval_every=rounds)
    print(f"user-level epsilon {result.epsilon:.3f} at delta {result.delta:g}: held-out perplexity "
          f"{result.records[-1]['eval_perplexity']:.2f} (of {len(make_task().model().out.bias)} characters)")
    return result


if __name__ == "__main__":
    main()
