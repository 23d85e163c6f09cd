"""fed_dp.server: the server of a Flower run — the user-level DP Strategy, its round loop and the ServerApp."""
