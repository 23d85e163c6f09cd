"""fed_dp.server: the server of a Flower run — the user-level DP Strategy (over the core's round loop) and the ServerApp."""
