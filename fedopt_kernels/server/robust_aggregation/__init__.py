"""Byzantine-robust aggregation on the server: the rules (median, trimmed mean, Krum,
Bulyan, geometric median, centered clipping, norm bounding) as the round's aggregator."""
