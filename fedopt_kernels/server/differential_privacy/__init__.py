"""Differential privacy on the server: DP-FedAvg's aggregation (fixed and adaptive
clipping, seeded noise), the settings that keep its guarantee, the round's privacy
component and its accountant."""
