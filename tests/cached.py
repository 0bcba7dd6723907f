"""Decoding through the KV cache, for tests that compare it with the full forward pass."""

import torch


def cached_logits(model, tokens: torch.Tensor, prefill: int, cache_len: int) -> torch.Tensor:
    """Logits (B, T, V) from a prefill of ``prefill`` tokens, then one token per call."""
    cache = model.new_cache(tokens.shape[0], cache_len)
    steps = [model(tokens[:, :prefill], cache=cache, cache_pos=torch.arange(prefill))]
    for t in range(prefill, tokens.shape[1]):
        steps.append(model(tokens[:, t : t + 1], cache=cache, cache_pos=torch.tensor([t])))
    return torch.cat(steps, dim=1)
