"""The decode loop's kernels: the n-gram proposer and the rejection sampler (reference, torch and Triton)."""

# "No token here": a draft slot without a draft, and the padding after a step's last emitted token.
NO_DRAFT = -1
