"""fed_dp.clients: what runs where users' data lives — the task interface, local training, the message protocol."""
