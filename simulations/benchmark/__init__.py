"""fed_dp.simulations.benchmark — ``fed-dp benchmark`` (``command``): its sections, the small-users comparison
(``small_users``), and Flower's own apps it compares with (``flower_baseline``, ``flower_echo``)."""
