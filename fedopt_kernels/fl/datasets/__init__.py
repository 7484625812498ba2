"""The simulator's data: datasets (digits, Synthetic, LEAF), partitions over clients and
the seeded corruption and attacks of some clients."""
