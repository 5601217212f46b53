"""Real decode-loop kernels: n-gram proposer and rejection sampler (reference, torch, Triton)."""
