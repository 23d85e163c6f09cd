"""fed_dp.simulations: built-in tasks and datasets, the in-process engine, the runner, CLI, plots, benchmark."""
