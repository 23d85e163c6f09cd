"""fed_dp.simulations — the folder simulations/, layer 3 of 4 (the top): tasks, the simulator, the commands.

Imported as ``fed_dp.simulations``, never as ``simulations`` (pyproject.toml's package-dir maps the folder). It
may import every layer below; none imports it (the core finds the built-in tasks through the entry-point group
``fed_dp.tasks``). By concern: ``tasks`` (built-in tasks and datasets), ``engine`` (the in-process simulator),
``experiments`` (config files: runner, tuning, plots), ``benchmark``, ``launch`` (Flower runs started from this
machine: local simulations and deployments, ``fed-dp submit``); the ``fed-dp`` command (``cli``) and ``fed-dp audit``
(``audit``)."""
