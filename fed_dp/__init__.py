"""fed_dp: the framework-agnostic core of user-level DP federated training (no Flower imports).

Modules follow ALGORITHMS.md:
    config             PrivacyConfig — one frozen object for sampler, noise and accounting
    flat               ParamLayout — a model update as one float32 vector and back
    clipping           L2 clip of whole user updates; scaled-geometry clip (scale-then-privatize)
    strategy           BandMF strategy matrices C (banded, Toeplitz, optimized for a workload)
    noise              privatizers: streaming independent / BandMF Gaussian noise
    aggregation        the DP query: noisy sum over the fixed denominator B
    sampling           user samplers, each with its dp_accounting event
    accounting         ε with dp_accounting, calibration of σ, per-round ledger with budget
    adaptive_clipping  quantile-tracking clip norm with its noise split
    optimizers         server optimizers as pure transforms: DP-FedAvg/SGD, DP-Adam(BC/W/W-BC), IME, STP, AdaGrad
    moment_estimation  the joint Gaussian query [Σu ; α·Σu²] of independent moment estimation
    diagnostics        ν̂ / ν̂ − Φ̂ summaries and update alignment (the seeds' figures)
    context            simulation vs deployment; non-private baselines only in simulations
    round              the one private round: init_server, begin_round, finish_round (every engine)
    validation         shared argument checks
"""

__version__ = "0.1.0"
