"""A stand-in for public pre-training, then private fine-tuning (docs/tutorials/fine-tune.md). Needs the hf part.

    python examples/fine_tune.py

1. Public text: a small GPT-2 (2 layers, 64 wide) is pre-trained *without* privacy on sequences of one synthetic
   Markov language, then saved with save_pretrained (what a downloaded checkpoint would be).
2. Users' text: another group of users write in a related language (a quarter of its transition rows differ).
   The same model is trained on them with user-level DP at one ε, three ways: LoRA (r = 8 on the attention's and
   the MLP's input layers) on the pretrained model, every parameter of the pretrained model, and every parameter
   from fresh weights (from scratch), with the same clip norm, learning rates, rounds and cohorts.
Each is scored on held-out text of the users' language (next-token loss and accuracy).
"""

from __future__ import annotations

import sys
import tempfile
import warnings

import torch

import fed_dp
from fed_dp import LocalTraining, PrivacyConfig, losses
from fed_dp.simulations.tasks import hf as hf_tasks
from fed_dp.simulations.tasks import synthetic


def pretrain(folder: str, *, sequences: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Non-private pre-training on the public language (shift 0), saved to ``folder``."""
    task = hf_tasks.markov_task(lora_r=0, users=1, sequences=1, eval_sequences=512, shift=0.0, seed=seed)
    public = synthetic.markov_sequences(synthetic.markov_chain(64, seed=seed), sequences, 24, seed=seed + 100)
    torch.manual_seed(seed)
    model = task.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = public[torch.randint(0, sequences, (64,), generator=generator)]
        optimizer.zero_grad()
        losses.next_token(model, (batch,)).backward()
        optimizer.step()
    hf_tasks.save_pretrained(model, folder)
    model.eval()
    with torch.no_grad():
        return task.evaluate(model)  # held-out text of the public language


def main(users: int = 1000, rounds: int = 30, epsilon: float = 3.0, pretrain_steps: int = 400,
         public_sequences: int = 20000, seed: int = 0) -> dict[str, dict[str, float]]:
    privacy = PrivacyConfig(expected_cohort=min(100, users // 2), rounds=rounds, target_epsilon=epsilon, delta=1e-5,
                            clip_norm=0.1, accountant="rdp")
    local = LocalTraining(epochs=1, batch_size=8, lr=0.5)  # one full-batch step of each user's 8 sequences
    results = {}
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        public = pretrain(folder, sequences=public_sequences, steps=pretrain_steps, seed=seed)
        print(f"pre-trained without privacy: public held-out accuracy {public['eval_accuracy']:.3f}")
        arms = {"LoRA r=8, pretrained": dict(pretrained=folder, lora_r=8, lora_targets="c_attn,c_fc"),
                "every parameter, pretrained": dict(pretrained=folder, lora_r=0),
                "every parameter, from scratch": dict(pretrained=None, lora_r=0)}
        for name, options in arms.items():
            task = hf_tasks.markov_task(users=users, seed=seed, **options)
            result = fed_dp.train(task, privacy, fed_dp.make_optimizer("dp-adam", lr=0.02), local, seed=seed,
                                  eval_every=rounds)
            before, after = result.records[0], result.records[-1]
            results[name] = {"epsilon": result.epsilon, "trainable": int(result.params.numel()),
                             "before": before["eval_accuracy"], "accuracy": after["eval_accuracy"],
                             "loss": after["eval_loss"]}
            print(f"{name:31s} trainable {result.params.numel():>7,}  epsilon {result.epsilon:.3f}  held-out "
                  f"accuracy {before['eval_accuracy']:.3f} -> {after['eval_accuracy']:.3f}  loss "
                  f"{before['eval_loss']:.3f} -> {after['eval_loss']:.3f}")
    return results


if __name__ == "__main__":
    main(**({"users": int(sys.argv[1])} if len(sys.argv) > 1 else {}))
