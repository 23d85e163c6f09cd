"""fed_dp.clients — the folder clients/, layer 1 of 4 (above the core): what runs where users' data lives.

Imported as ``fed_dp.clients``, never as ``clients`` (pyproject.toml's package-dir maps the folder). It imports the
core (``fed_dp``) and nothing above it. The task interface (``task``, ``losses``, ``evaluation``), local training
and clipping (``training``, ``vectorized``, ``one_step``, and the choice among them: ``training_paths``), a node's
users trained into one contribution (``node``, no Flower), the messages of both sides (``protocol``), a node's
replies (``replies``, ``handlers``), the project's ClientApp (``app``) and its node service (``node_service``)."""
