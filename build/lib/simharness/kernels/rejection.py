"""Rejection sampler for n-gram drafts (one-hot q): readable torch reference (the fused Triton version is
`kernels.rejection_triton`, imported only where it runs).

Semantics (docs/design.md "Kernels", docs/vllm-notes.md "Rejection sampler"): greedy rows (temperature 0) accept
draft i while it equals argmax(logits[i]) and emit that argmax at the first rejection; random rows accept draft x
with probability min(1, p_i(x)) where p = softmax(logits / T), and at the first rejection sample from p_i with x
removed (Leviathan et al. 2023 with q = one-hot). If every draft is accepted, a bonus token comes from position
num_drafts. A -1 draft is always rejected. Output [B, k+1] int64 padded with -1, and num_emitted = accepted + 1.
"""

import torch


def rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seed: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts: the fused Triton kernels on CUDA, the torch reference elsewhere. `seed` may be a
    one-element int64 tensor on the logits' device (a CUDA graph's staged seed)."""
    if target_logits.is_cuda:
        from simharness.kernels.rejection_triton import rejection_sample_triton  # Triton: only where it runs

        return rejection_sample_triton(target_logits, draft_tokens, num_drafts, temperature, seed=seed)
    return rejection_sample_reference(target_logits, draft_tokens, num_drafts, temperature, seed=int(seed))


def _assemble(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output row: the accepted drafts, then the token at position num_accepted, then -1."""
    batch, k = draft_tokens.shape
    columns = torch.arange(k + 1, device=draft_tokens.device)
    padded_drafts = torch.cat([draft_tokens.long(), draft_tokens.new_full((batch, 1), -1).long()], dim=1)
    output = torch.where(columns < num_accepted[:, None], padded_drafts, -1)
    last = num_accepted[:, None]
    output.scatter_(1, last, final_tokens.gather(1, last))
    return output, (num_accepted + 1).to(torch.int32)


def rejection_sample_reference(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch over whole [B, k+1, V] tensors; randomness from a torch.Generator seeded with `seed`."""
    batch, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    device = target_logits.device
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = target_logits.float()
    greedy = (temperature == 0).to(device)[:, None]
    num_drafts = num_drafts.to(device)

    positions = torch.arange(k, device=device)
    is_draft = (positions[None, :] < num_drafts[:, None]) & (draft_tokens >= 0)
    drafts = draft_tokens.long().clamp(min=0)

    # Greedy rows: the target token is the argmax (lowest index on ties, like torch.argmax).
    argmax = logits.argmax(dim=-1)
    greedy_accept = is_draft & (drafts == argmax[:, :k])

    # Random rows: accept x with probability p(x) (q(x) = 1 for a one-hot draft).
    safe_temperature = torch.where(temperature == 0, 1.0, temperature).float().to(device)
    probs = torch.softmax(logits / safe_temperature[:, None, None], dim=-1)
    p_draft = probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    # One row of uniforms per batch row, drawn in row order: on the CPU (whose generator fills in order) a row's
    # randomness does not depend on the rows after it, so a batch padded to a graph's bucket samples the same tokens.
    draws = torch.rand((batch, k + k_plus_1 * vocab), generator=generator, device=device)
    uniform = draws[:, :k]
    random_accept = is_draft & (uniform < p_draft)

    accept = torch.where(greedy, greedy_accept, random_accept)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading run of accepted drafts

    # Recovery at a rejected draft samples from p with x removed; the bonus position samples from p.
    removed = torch.zeros_like(probs)
    removed[:, :k].scatter_(-1, drafts[..., None], is_draft[..., None].float())
    residual = probs * (1 - removed)
    # Exponential race: argmax(r / E), E ~ Exp(1), draws index j with probability r_j / sum(r).
    noise = -torch.log(draws[:, k:].view(batch, k_plus_1, vocab))
    sampled = (residual / noise).argmax(dim=-1)

    final_tokens = torch.where(greedy, argmax, sampled)
    return _assemble(draft_tokens, num_accepted, final_tokens)
