"""fed_dp.simulations.engine — the in-process simulator (``inprocess``: ``fed_dp.train``) and its spread over
``torchrun`` processes (``distributed``); both run the core's one round loop (``fed_dp.round_loop``)."""
