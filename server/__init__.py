"""fed_dp.server — the folder server/, layer 2 of 4 (above clients): the server of a Flower run.

Imported as ``fed_dp.server``, never as ``server`` (pyproject.toml's package-dir maps the folder). It imports
``fed_dp.clients`` and the core, nothing above. The user-level DP Strategy over the core's round loop
(``flower_strategy``), who hosts which users (``membership``), a round's messages (``messaging``) and the project's
ServerApp (``app``). The launchers of Flower runs (``fed-dp submit``, local simulations and deployments) are tooling
above it, in ``fed_dp.simulations.launch``."""
