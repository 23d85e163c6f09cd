"""fed_dp.simulations.experiments — experiment files (``simulations/configs/*.toml``): run every optimizer of one
(``runner``), tune its server learning rates (``tune``), plot its results (``plots``)."""
