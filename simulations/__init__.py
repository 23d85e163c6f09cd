"""fed_dp.simulations — the top floor: ``tasks`` (built-in tasks and datasets), ``engine`` (the in-process
simulator), ``experiments`` (runner, tuning, plots), ``benchmark``, the ``fed-dp`` command (``cli``) and ``audit``."""
