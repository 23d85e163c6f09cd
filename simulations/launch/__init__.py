"""fed_dp.simulations.launch — Flower runs started from this machine: ``flwr run`` of an app in Flower's simulation
engine, isolated (``local_simulation``), a SuperLink and SuperNodes as processes on 127.0.0.1 (``local_deployment``)
and ``fed-dp submit`` (``submit``: a run on a deployment, its exit status from the run's final status). They start
Flower's own executables; the ServerApp and ClientApp they run are ``fed_dp.server`` and ``fed_dp.clients``'s."""
