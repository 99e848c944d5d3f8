"""Model side: loading weights, the forward pass, attention backends and the sampler."""
