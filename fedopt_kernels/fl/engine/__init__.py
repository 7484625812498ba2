"""The simulator's engine: local training (one client, or a round's clients batched), the
round's plan and chunks, the per-client state and the models it trains."""
