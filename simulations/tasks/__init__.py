"""fed_dp.simulations.tasks — the built-in tasks (``builtin``) and what they are made of: synthetic data, local
dataset files, federated datasets (LEAF, StackOverflow, FLAIR), the tokenizer, partitioning into users, models."""
