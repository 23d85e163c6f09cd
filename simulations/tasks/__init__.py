"""fed_dp.simulations.tasks — the built-in tasks (``builtin``) and what they are made of: synthetic data, local
dataset files, federated datasets (LEAF, StackOverflow, FLAIR), the tokenizer, partitioning into users, models.

The built-in tasks' short names (``task.ref = "heavy-tail"``) are this package's table in pyproject.toml's
entry-point group ``fed_dp.tasks``; the core reads it from the installed metadata
(``fed_dp.task_registry.registered_tasks``) without naming this package."""
