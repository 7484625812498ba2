"""A simulated run: its config and recipes, the round loop (plain, distributed, on a
device clock), the server side of a round, results, interrupts."""
