"""The attention function every exported graph and every torch reference uses.

Plain matmul-softmax-matmul (no sdpa, whose export adds IsNaN/Where nodes to every block),
softmax in fp32, and grouped-query attention computed by folding the query heads that
share a KV head into the row dimension instead of repeating K and V: identical results,
no copy of the cache per step.
"""

from __future__ import annotations

NAME = "trtserve_eager"
_registered = False


def grouped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kwargs):
    """`softcap` (Gemma 2): scores become tanh(scores / cap) * cap before the mask. A sliding window arrives
    in the mask (kwargs' sliding_window is for kernels that take it separately)."""
    import torch

    batch, heads, q_len, head_dim = query.shape  # (B, H, S, D)
    kv_heads = key.shape[1]  # key/value: (B, Hkv, T, D)
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * q_len, head_dim)  # (B, Hkv, G*S, D)
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling  # (B, Hkv, G*S, T)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(batch, kv_heads, groups, q_len, -1)  # (B, Hkv, G, S, T)
    if attention_mask is not None:
        # (B, 1, S, T) additive mask with finite minimum -> broadcast over Hkv and G
        scores = scores + attention_mask[:, :, None, :, :]
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    probs = probs.reshape(batch, kv_heads, groups * q_len, -1)
    out = torch.matmul(probs, value)  # (B, Hkv, G*S, D)
    out = out.reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous()  # (B, S, H, D)
    return out, None


def register() -> str:
    """Register the function with transformers once; return the attn_implementation name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

        AttentionInterface.register(NAME, grouped_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
        _registered = True
    return NAME
