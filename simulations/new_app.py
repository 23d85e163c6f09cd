"""``fed-dp new NAME``: a runnable Flower app with fed-dp's user-level DP strategy, for the user to edit.

    NAME/pyproject.toml   [project] without fed-dp in its dependencies (see DEPENDENCIES_NOTE), the Flower app's
                          components, and every fed-dp run-config key with its default (``[tool.flwr.app.config]``,
                          from the one schema: ``fed_dp.run_config.flower_defaults``)
    NAME/server_app.py    a ServerApp running ``UserLevelDP`` (a subclass, ready for configure_train/aggregate_train);
                          it prints ε and the held-out evaluation before round 1 and after the last
    NAME/client_app.py    fed-dp's ClientApp (``fed_dp.client_app``): a node trains the sampled users it hosts
    NAME/task.py          the model, the users' data, the loss and the held-out evaluation: what the user edits
                          (``--model hf``: a Hugging Face GPT-2 with a peft LoRA adapter, ``fed_dp.clients.hf``)
    NAME/README.md        how to run it and what to change

``flwr run NAME`` (or ``flwr run .`` inside it) trains it in Flower's local simulation. The files use fed-dp's public
API only (the names ``fed_dp`` exports, docs/reference/python-api.md): what a user copies from them keeps working.
"""

from __future__ import annotations

import re
from pathlib import Path

from fed_dp.run_config import flower_defaults
from fed_dp.simulations.launch.local_simulation import format_run_config

#: What the generated pyproject.toml says about its (empty) dependency list, and why.
DEPENDENCIES_NOTE = """\
# Dependencies: fed-dp, torch and flwr come from the Python environment you run `flwr run` in (and, in a
# deployment, from each SuperNode's): install fed-dp there from its source (pip install -e <fed-dp clone>). Do not list fed-dp below. When Flower starts
# this app it installs the app's [project] dependencies itself (runtime dependency installation, on by default
# for the local SuperLink that `flwr run` starts): `uv sync` of this list from the package index into a fresh
# environment for the run, placed in front of the running one. fed-dp is not installable from the index, so listing it fails
# the run ("Runtime installation of app dependencies failed", exit code 608 in the log) while `flwr run` itself
# exits 0; listing torch would download it again for every run. List here only packages your task needs that the
# environment lacks and the index has (flwr itself is always skipped)."""

#: The template's settings that differ from fed-dp's defaults: its task, and a server learning rate at which
#: DP-Adam learns task.py's example within the default 5 rounds (measured in process, σ = 1, ε 4.56: held-out
#: accuracy 0.35 → 0.65; at the default 1e-3 the model stays where it started; 20 rounds reach 0.94 at ε 8.1).
TEMPLATE_SETTINGS = {"task.ref": "task:make_task", "optimizer.lr": 0.05}
#: ``--model hf``: more users per round, more rounds and a larger local step, at which its LoRA adapter learns the
#: example (measured in process, σ = 1, ε 4.98 at PLD's default accounting: held-out next-token accuracy 0.00 → 0.67
#: with LoRA on c_attn and a trainable output layer; the template's 5 rounds of 10 users reached 0.12).
HF_TEMPLATE_SETTINGS = {"privacy.expected-cohort": 40, "privacy.rounds": 10, "local.lr": 0.5}

SERVER_APP = '''\
"""ServerApp: fed-dp's user-level DP strategy in place of FedAvg.

Every key of [tool.flwr.app.config] (privacy.*, optimizer.*, local.*, server.*, task.*) is read by
fed_dp.RunConfig; override any with `flwr run . --run-config "privacy.rounds=10"`. Everything comes from fed_dp's
public API (docs/reference/python-api.md).
"""

import secrets

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fed_dp import RunConfig, UserLevelDP, build_task, centralized_evaluation, model_arrays


class Strategy(UserLevelDP):
    """Your strategy. As with Flower's FedAvg, override configure_train (e.g. add keys to the config every
    ClientApp receives) or aggregate_train (e.g. log or add metrics), and call super() inside: the base methods
    sample the users and run the private aggregation (re-clip, noise, privacy ledger), which no override skips."""


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = RunConfig.from_flat(context.run_config)
    task = build_task(run.task)  # task.py's make_task (task.ref), called with the task.* keys
    # run.seed seeds the initial model as the nodes seed theirs (frozen parameters must match); unset: a fresh seed
    model = task.build_model(seed=run.run.seed if run.run.seed is not None else secrets.randbits(62))
    strategy = Strategy.from_run_config(run, task.num_users, frozen=model)
    result = strategy.start(grid=grid, initial_arrays=model_arrays(model), timeout=run.server.reply_timeout,
                            evaluate_fn=centralized_evaluation(task, model))
    # the held-out evaluation before round 1 (round 0) and after the last round
    evaluated = [record for record in result.records if any(key.startswith("eval_") for key in record)]
    before, after = (evaluated[0], evaluated[-1]) if evaluated else ({}, {})
    change = ", ".join(f"{key[5:]} {before[key]:.3f} -> {after[key]:.3f}" for key in after
                       if key.startswith("eval_") and key in before)
    rounds = result.records[-1]["round"] if result.records else 0
    print(f"{rounds} rounds, user-level epsilon {result.epsilon:.2f} at delta {result.delta:g}; held-out "
          f"{change or 'not evaluated'} (before round 1 -> after round {after.get('round', rounds)})")
'''

CLIENT_APP = '''\
"""ClientApp: fed-dp's own. A node tells the server which users it hosts (and which model it trains), then trains
the sampled ones from the global model, clips each user's update and sends their sum (fed_dp's query_reply,
train_reply and LocalTrainer are the pieces for a ClientApp of your own). It loads the task named by task.ref in
[tool.flwr.app.config].
"""

import task  # noqa: F401  (this folder's task.py, imported while Flower loads the app: task.ref names it)
from fed_dp import client_app as app

__all__ = ["app"]
'''

TASK = '''\
"""The task: the model, the users' data, the loss and the held-out evaluation. Edit it.

fed-dp protects each *user* (all the examples of one person), not single examples. `Users.split` groups the
examples by a user column; `Users` also loads users lazily from files (see fed_dp.Users). The server evaluates
the global model on held-out data (`evaluate`), never on users' data. Keyword arguments of make_task are set from
[tool.flwr.app.config]'s task.* keys (task.users, task.examples; "" keeps the default below).
"""

import torch
from torch import nn

from fed_dp import Task, Users, evaluation, losses


def make_task(users: int = 40, examples: int = 30) -> Task:
    """Three Gaussian classes in 8 dimensions: ``users`` users with ``examples`` examples each, 300 held out.
    The data are drawn from a fixed seed, so the server and every node build the same task."""
    generator = torch.Generator().manual_seed(0)
    centers = 2 * torch.randn(3, 8, generator=generator)
    count = users * examples
    labels = torch.randint(0, 3, (count + 300,), generator=generator)
    inputs = centers[labels] + torch.randn(count + 300, 8, generator=generator)
    return Task(
        model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)),
        users=Users.split((inputs[:count], labels[:count]), torch.arange(count) % users),
        loss=losses.classification,
        evaluate=evaluation.classification((inputs[count:], labels[count:])),
        name="gaussian-classes",
    )
'''

TASK_HF = '''\
"""The task: a Hugging Face GPT-2 with a LoRA adapter (peft), fine-tuned on users' token sequences. Edit it.

Needs transformers and peft (pip install transformers peft, or fed-dp's hf part). Only the adapter (LoRA on the
attention, and a trainable copy of the output layer) trains: the update, the clip, the noise and the messages cover
its parameters, and the frozen GPT-2 never leaves a process. Every process builds the same frozen weights: from
task.pretrained (a local save_pretrained folder, the same on every machine) or, without it, from a fresh
initialization seeded by init_seed=0. The server checks before round 1 that every node holds the same ones.
"""

import torch
from peft import LoraConfig
from transformers import GPT2Config

from fed_dp import Task, Users
from fed_dp.clients import hf


def make_task(users: int = 200, pretrained: str = "") -> Task:
    """Each user writes 8 sequences of 16 tokens (of 32) that count up by one, from random starts; 64 held out."""
    generator = torch.Generator().manual_seed(0)

    def counting(count: int) -> torch.Tensor:
        return (torch.randint(0, 32, (count, 1), generator=generator) + torch.arange(16)) % 32

    per_user = [(counting(8), torch.ones(8, 16)) for _ in range(users)]
    source = pretrained or GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                      eos_token_id=0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True,
                      modules_to_save=["lm_head"])
    return hf.hf_task(model=lambda: hf.transformer(source, "causal-lm", peft_config=lora, init_seed=0),
                      head="causal-lm", users=Users.in_memory(per_user), held_out=(counting(64), torch.ones(64, 16)),
                      name="counting")
'''

README = '''\
# {name}

A Flower app that trains with user-level differential privacy: fed-dp's `UserLevelDP` strategy (server_app.py),
fed-dp's ClientApp (client_app.py) and a task of your own (task.py).

Run it in Flower's local simulation, from this folder, in the environment where fed-dp is installed:

    flwr run . --stream
    flwr run . --stream --run-config "privacy.rounds=20 privacy.expected-cohort=8 server.checkpoint-dir='/abs/ckpt'"

The ServerApp logs every round's ε, then prints the user-level ε spent and the held-out evaluation before round 1
and after the last. With `server.checkpoint-dir` (an absolute path) every round is saved there, with
`results.json`, and a new run resumes from it.

- task.py: your model, users' data, loss and held-out evaluation.
- pyproject.toml, `[tool.flwr.app.config]`: every fed-dp setting with its default; an optional key
  holds "" (unset; e.g. `privacy.num-users = ""` means the task's number of users). fed-dp is deliberately not in `[project] dependencies`: the comment
  there says why.
- server_app.py: `Strategy` subclasses `UserLevelDP`; override `configure_train` / `aggregate_train` as with
  Flower's strategies, calling `super()`.
'''


def _check_name(name: str) -> str:
    """The folder's name as the app's name (a Flower app name: letters, digits, '-' and '_', starting with a letter, at most 32 characters (Flower's
    limit for app names))."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,31}", name):
        raise ValueError(f"app name {name!r} (the folder's name): use letters, digits, '-' and '_', starting with a "
                         "letter, at most 32 characters (e.g. fed-dp new my-app)")
    return name


#: The task options each template's task.py takes (``[tool.flwr.app.config]``'s task.* keys), by ``--model``.
TASK_OPTIONS = {"torch": {"users": "", "examples": ""}, "hf": {"users": "", "pretrained": ""}}


def pyproject(name: str, model: str = "torch") -> str:
    """The app's pyproject.toml: [project] (see :data:`DEPENDENCIES_NOTE`), [tool.flwr.app] and its components,
    and every run-config key of the schema with its default, ``task.ref`` naming this app's task.py."""
    defaults = {**flower_defaults(TASK_OPTIONS[model]), **TEMPLATE_SETTINGS,
                **(HF_TEMPLATE_SETTINGS if model == "hf" else {})}
    config = "\n".join(f"{key} = {format_run_config({key: value}).partition('=')[2]}" for key, value in defaults.items())
    return f'''# A Flower app using fed-dp (written by `fed-dp new`). Run it with `flwr run . --stream`.

[project]
name = "{name}"
version = "0.1.0"
description = "A user-level DP Flower app built on fed-dp"
license = "Apache-2.0"
{DEPENDENCIES_NOTE}
dependencies = []

[tool.flwr.app]
publisher = "{name}"

[tool.flwr.app.components]
serverapp = "server_app:app"
clientapp = "client_app:app"

# No [tool.flwr.federations] table: in flwr 1.42 the SuperLinks you connect to live in $FLWR_HOME/config.toml
# (its default connection, "local", runs Flower's simulation), and `flwr run` moves such a table there and comments
# it out here. The local simulation's size: flwr run . --federation-config "num-supernodes=4".

# Every fed-dp setting with its default (fed_dp.run_config), except task.ref (task.py's make_task) and optimizer.lr
# (0.05: DP-Adam's default 1e-3 barely moves task.py's example model in 5 rounds; retune it for your task). A Flower
# run config cannot leave a key out, so an unset key holds "". Override any with
# --run-config "privacy.rounds=10 local.lr=0.05".
[tool.flwr.app.config]
{config}
'''


def write_app(folder: str | Path, model: str = "torch") -> Path:
    """Write the app into ``folder`` (its last component is the app's name), which must not exist or be an empty
    folder; returns it. ``model``: ``"torch"`` (task.py with a small torch model) or ``"hf"`` (task.py with a
    Hugging Face GPT-2 and a LoRA adapter: ``TASK_HF``, needs transformers and peft)."""
    if model not in TASK_OPTIONS:
        raise ValueError(f"--model must be one of {', '.join(TASK_OPTIONS)}, got {model!r}")
    target = Path(folder)
    name = _check_name(target.resolve().name)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{target} already exists and is not an empty folder: choose another name or folder "
                         "(fed-dp new never overwrites files)")
    target.mkdir(parents=True, exist_ok=True)
    files = {"pyproject.toml": pyproject(name, model), "server_app.py": SERVER_APP, "client_app.py": CLIENT_APP,
             "task.py": TASK_HF if model == "hf" else TASK, "README.md": README.format(name=name)}
    for file_name, text in files.items():
        (target / file_name).write_text(text, encoding="utf-8")
    return target
