"""fed_dp.simulations.benchmark — ``fed-dp benchmark`` (``command``; its command line in ``arguments``) and one
module per section: ``w1``, ``scaling``, ``noise`` (with secure noise), ``accounting``, ``gpu``, ``deployment``,
``small_users``, ``paths``; ``measure`` (what they time with), and Flower's own apps they compare with
(``flower_baseline``, ``flower_echo``)."""
