"""``fed-dp benchmark --only finetune``: what fine-tuning costs under user-level DP, from tiny models to GPT-2-small.

Each workload (Hugging Face GPT-2 models through ``fed_dp.clients.hf``, users of a few token sequences each whose
local training is one full-batch step, on the CPU with one torch thread, or on CUDA) runs the in-process engine
twice with the same users, seeds and cohorts: private (σ = 1, DP-Adam) and non-private (σ = 0, the same clip and
the same optimizer), alternating, ``rounds`` rounds each, the first left out as warm-up. Printed side by side:

- the trainable count d (the dimension of the update, the clip, the noise and the optimizer state) and the total;
- seconds per round and per user (median round over its users) of both, and their ratio, private over
  non-private: the cost of the noise and of the optimizer on d coordinates (issue 38 asked ≤ 1.3 for LoRA GPT-2);
- the training path the engine took (one-step: no model per user; else sequential or vectorized);
- the peak resident memory of the private run (``VmHWM``, reset before it where Linux allows);
- the bytes per user on the wire: the arrays of a TRAIN message to a node hosting one user and of its reply (the
  trainable part, each way), against the same two messages carrying the full model.

The workloads: a 2-layer, 64-wide GPT-2 with LoRA r = 8 on ``c_attn`` and the same model trained in full; a
2-layer, 128-wide GPT-2 with LoRA r = 8 on ``c_attn`` (8,192 trainable: the model of issue 38); GPT-2-small's
architecture (12 layers, 768 wide, its 50,257-token vocabulary: 124M parameters) with LoRA r = 8 on ``c_attn``
(``smoke`` leaves it and the full tiny model out). Weights are fresh (nothing is downloaded): the cost does not
depend on them.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fed_dp.clients import hf
from fed_dp.clients.task import Task, Users, trainable_parameters
from fed_dp.config import LocalTraining, PrivacyConfig
from fed_dp.optimizers import make_optimizer
from fed_dp.simulations.benchmark.measure import table, torch_threads
from fed_dp.simulations.benchmark.small_users import peak_resident_bytes, reset_peak_resident
from fed_dp.simulations.engine import inprocess as engine

__all__ = ["FineTuneWorkload", "bench_finetune", "format_finetune", "workloads"]


@dataclass(frozen=True)
class FineTuneWorkload:
    """A GPT-2 architecture (layers, width, heads, vocabulary), LoRA rank (0: every parameter), and the users."""

    label: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    lora_r: int
    users: int = 64
    cohort: int = 16
    sequences: int = 4
    length: int = 32

    def task(self) -> Task:
        transformers = hf.require()
        config = transformers.GPT2Config(vocab_size=self.vocab, n_positions=self.length, n_embd=self.hidden,
                                         n_layer=self.layers, n_head=self.heads, bos_token_id=0, eos_token_id=0)
        lora = None
        if self.lora_r:
            import peft

            lora = peft.LoraConfig(r=self.lora_r, lora_alpha=2 * self.lora_r, lora_dropout=0.0,
                                   target_modules=["c_attn"], fan_in_fan_out=True)
        generator = torch.Generator().manual_seed(0)
        rows = [(torch.randint(0, self.vocab, (self.sequences, self.length), generator=generator),
                 torch.ones(self.sequences, self.length)) for _ in range(self.users)]
        return hf.hf_task(model=lambda: hf.transformer(config, "causal-lm", peft_config=lora, init_seed=0),
                          head="causal-lm", users=Users.in_memory(rows), name=self.label)

    def privacy(self, rounds: int, sigma: float) -> PrivacyConfig:
        return PrivacyConfig(num_users=self.users, expected_cohort=self.cohort, rounds=rounds, noise_multiplier=sigma,
                             clip_norm=1.0, delta=1e-5, accountant="rdp")


def workloads(*, smoke: bool) -> list[FineTuneWorkload]:
    """The workloads of the module docstring (``smoke``: the two small LoRA ones, a few users)."""
    chosen = [
        FineTuneWorkload("GPT-2 2x64, LoRA r=8", 2, 64, 2, 512, 8),
        FineTuneWorkload("GPT-2 2x64, every parameter", 2, 64, 2, 512, 0),
        FineTuneWorkload("GPT-2 2x128, LoRA r=8 (issue 38)", 2, 128, 2, 512, 8),
        FineTuneWorkload("GPT-2-small 124M, LoRA r=8", 12, 768, 12, 50257, 8, users=16, cohort=4),
    ]
    if smoke:
        return [FineTuneWorkload(w.label, w.layers, w.hidden, w.heads, w.vocab, w.lora_r, users=8, cohort=4,
                                 sequences=2, length=8) for w in (chosen[0], chosen[2])]
    return chosen


def wire_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the arrays of one TRAIN message and its reply for a node hosting one user (θ down, Σu up):
    (trainable part, full model), from the Flower ArrayRecords themselves."""
    from flwr.app import ArrayRecord

    def record_bytes(named: dict[str, torch.Tensor]) -> int:
        record = ArrayRecord(torch_state_dict=OrderedDict((k, v.detach().cpu()) for k, v in named.items()))
        return sum(len(array.data) for array in record.values())

    trained = record_bytes(trainable_parameters(model))
    full = record_bytes(dict(model.named_parameters()))
    return 2 * trained, 2 * full


def _round_seconds(workload: FineTuneWorkload, task: Task, sigma: float, rounds: int, device: str) -> tuple[list[float], dict[str, Any]]:
    records: list[dict[str, Any]] = []
    engine.train(task, workload.privacy(rounds, sigma), make_optimizer("dp-adam", lr=0.001),
                 LocalTraining(epochs=1, batch_size=workload.sequences, lr=0.1), seed=0, eval_every=0,
                 device=device, on_round=records.append)
    per_user = [r["nonprivate_round_seconds"] / max(1, r["nonprivate_cohort_size"]) for r in records[1:]]
    return per_user, records[-1]


def bench_finetune(chosen: list[FineTuneWorkload], rounds: int, *, device: str = "cpu",
                   log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Private and non-private seconds per user of every workload, alternating (module docstring)."""
    rows = []
    with torch_threads(1 if device == "cpu" else None):
        for workload in chosen:
            log(f"  {workload.label} ...")
            task = workload.task()
            model = task.build_model()
            trained = sum(p.numel() for p in trainable_parameters(model).values())
            total = sum(p.numel() for p in model.parameters())
            wire, wire_full = wire_bytes(model)
            del model
            private: list[float] = []
            public: list[float] = []
            peak_reset = reset_peak_resident()
            seconds, last = _round_seconds(workload, task, 1.0, rounds, device)
            private += seconds
            peak = peak_resident_bytes()
            public += _round_seconds(workload, task, 0.0, rounds, device)[0]
            private += _round_seconds(workload, task, 1.0, rounds, device)[0]
            public += _round_seconds(workload, task, 0.0, rounds, device)[0]
            path = "one-step" if last.get("nonprivate_one_step") else \
                ("vectorized" if last.get("nonprivate_vectorized") else "sequential")
            rows.append({"workload": workload.label, "trainable": trained, "total": total, "path": path,
                         "private_per_user": statistics.median(private), "nonprivate_per_user": statistics.median(public),
                         "ratio": statistics.median(private) / statistics.median(public),
                         "peak_bytes": peak, "peak_reset": peak_reset, "wire_bytes": wire, "wire_full_bytes": wire_full,
                         "cohort": workload.cohort, "rounds": rounds, "device": device})
    return rows


def format_finetune(rows: list[dict[str, Any]]) -> str:
    return table(["workload", "trainable / total", "path", "private s/user", "non-private s/user",
                  "private / non-private", "peak memory", "wire bytes/user (full model)"],
                 [[r["workload"], f"{r['trainable']:,} / {r['total']:,}", r["path"], f"{r['private_per_user']:.4f}",
                   f"{r['nonprivate_per_user']:.4f}", f"{r['ratio']:.2f}", f"{r['peak_bytes'] / 2**20:,.0f} MiB",
                   f"{r['wire_bytes']:,} ({r['wire_full_bytes']:,})"] for r in rows])
