"""torch modules that fix the graph contract: named flat inputs and outputs, the mask built inside.

The same modules are exported to ONNX and run as the torch reference backend, so both take
identical feeds. HF's own mask code (data-dependent branches that the tracer would freeze) is
bypassed by passing a finished 4D additive mask with a finite minimum.
"""

from __future__ import annotations

from functools import lru_cache

ENCODER_OUTPUTS = ("last_hidden_state", "sentence_embedding")
SCORER_OUTPUTS = ("logits",)  # a cross-encoder's classification logits (B, labels)


def additive_mask(allowed):
    """bool (B, 1, S, T) -> float32 additive mask: 0 where allowed, finite minimum elsewhere."""
    import torch

    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(allowed, zero, torch.finfo(torch.float32).min)


def encoder_input_names(uses_token_types: bool) -> list[str]:
    names = ["input_ids", "attention_mask"]
    return names + ["token_type_ids"] if uses_token_types else names


def decoder_input_names(num_layers: int) -> list[str]:
    names = ["input_ids", "attention_mask", "position_ids", "logit_positions"]
    for i in range(num_layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def decoder_output_names(num_layers: int) -> list[str]:
    names = ["logits"]
    for i in range(num_layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


def encoder_graph(model, pooling, dense: list, causal: bool = False):
    """`pooling` (models.pooling.Pooling) and its Dense modules' (weight, bias); `causal`: a decoder family used
    as an embedder attends to earlier tokens only."""
    return _classes()[0](model, pooling, dense, causal).eval()


def graph_for(model, source):
    """The graph module of a checkpoint (models.sources.ModelSource) by its kind: a decoder's (its windows), a
    cross-encoder's, or an encoder's (its pooling and Dense weights, causal attention where its family is a
    decoder's). The exporter traces it; the torch backend runs it."""
    from trtserve.engine_dir.kinds import ModelKind
    from trtserve.models.families import by_name
    from trtserve.models.pooling import load_dense

    kind = source.info.kind
    if kind == ModelKind.DECODER:
        return decoder_graph(model, source.info)
    if kind == ModelKind.SCORER:
        return scorer_graph(model)
    return encoder_graph(model, source.pooling, load_dense(source.path, source.pooling),
                         causal=by_name(source.info.family).kind == ModelKind.DECODER)


def scorer_graph(model):
    return _classes()[2](model).eval()


def decoder_graph(model, info):
    """`info` (models.family.ModelInfo) gives the layers' sliding windows and whether the model takes a
    {"full_attention": mask, "sliding_attention": mask} dict (models.families) rather than one mask."""
    from trtserve.models.families import by_name

    return _classes()[1](model, info.sliding_windows, by_name(info.family).masks_by_layer_type).eval()


@lru_cache(maxsize=1)
def _classes():
    """torch is imported only when a graph module is made: the package imports without it."""
    import torch
    from torch import nn

    class EncoderGraph(nn.Module):
        """(input_ids, attention_mask[, token_type_ids]) -> (last_hidden_state, sentence_embedding): the
        checkpoint's pooling modes concatenated, its Dense modules, its Normalize (models.pooling)."""

        def __init__(self, model: nn.Module, pooling, dense, causal: bool):
            super().__init__()
            self.model, self.causal = model, causal
            self.modes, self.normalize = pooling.modes, pooling.normalize
            self.activations = [d.activation for d in pooling.dense]
            self.dense = nn.ModuleList()
            for (weight, bias), module in zip(dense, pooling.dense):
                layer = nn.Linear(module.in_features, module.out_features, bias=bias is not None)
                layer.weight.data = torch.from_numpy(weight)
                if bias is not None:
                    layer.bias.data = torch.from_numpy(bias)
                self.dense.append(layer)

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            keep = attention_mask.bool()  # (B, S)
            allowed = keep[:, None, None, :]  # (B, 1, 1, S)
            if self.causal:  # right padding: real tokens are positions 0..n-1, as the model counts them
                seq = torch.arange(input_ids.shape[1], device=input_ids.device)
                allowed = allowed & (seq[None, :] <= seq[:, None])[None, None]  # (B, 1, S, S)
            extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
            hidden = self.model(input_ids=input_ids, attention_mask=additive_mask(allowed), **extra).last_hidden_state
            return hidden, self.pool(hidden, keep)

        def pool(self, hidden, keep):
            weights = keep.to(hidden.dtype)[:, :, None]  # (B, S, 1)
            count = weights.sum(1).clamp(min=1e-9)
            parts = []
            for mode in self.modes:
                if mode == "cls":
                    parts.append(hidden[:, 0])
                elif mode == "max":
                    parts.append(torch.where(keep[:, :, None], hidden, torch.full_like(hidden, -1e9)).max(1).values)
                elif mode in ("mean", "mean_sqrt_len"):
                    total = (hidden * weights).sum(1)
                    parts.append(total / (count if mode == "mean" else count.sqrt()))
                elif mode == "weightedmean":
                    ranks = weights * torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[None, :, None]
                    parts.append((hidden * ranks).sum(1) / ranks.sum(1).clamp(min=1e-9))
                else:  # lasttoken: the last position the mask keeps
                    last = (keep.long() * torch.arange(hidden.shape[1])[None]).argmax(1)
                    parts.append(hidden[torch.arange(hidden.shape[0]), last])
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            for layer, activation in zip(self.dense, self.activations):
                out = layer(out)
                out = {"identity": lambda x: x, "tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid,
                       "gelu": nn.functional.gelu}[activation](out)
            if self.normalize:
                out = out / out.norm(dim=1, keepdim=True).clamp(min=1e-12)
            return out

    class DecoderGraph(nn.Module):
        """One graph for prefill and decode: past length P may be 0.

        inputs: input_ids (B, S), attention_mask (B, P+S), position_ids (B, S), logit_positions (K,)
        (the new positions whose logits are wanted, the same for every row: [S-1] to sample the next
        token, 0..S-1 for the prompt's logprobs), per layer past key and value (B, Hkv, P, D).
        outputs: logits (B, K, V), per layer present key and value (B, Hkv, P+S, D). The LM head runs
        on the K positions only: a prefill of S tokens no longer computes S vocabulary rows.
        """

        def __init__(self, model: nn.Module, windows, by_layer_type: bool):
            super().__init__()
            self.model = model
            found = {w for w in windows or () if w is not None}
            if len(found) > 1:
                raise ValueError(f"one sliding window size per model is supported, found {sorted(found)}")
            self.window = found.pop() if found else None
            self.by_layer_type = by_layer_type

        def masks(self, allowed, attention_mask, position_ids):
            """The additive mask each layer reads. A window counts real positions (padding excluded): key k is
            seen from query q where q - w < k, with k's position the count of real tokens before it."""
            if self.window is None:
                return additive_mask(allowed)
            k_real = torch.cumsum(attention_mask, dim=1) - 1  # (B, T)
            near = (position_ids[:, :, None] - k_real[:, None, :]) < self.window  # (B, S, T)
            windowed = additive_mask(allowed & near[:, None, :, :])
            if self.by_layer_type:
                return {"full_attention": additive_mask(allowed), "sliding_attention": windowed}
            return windowed

        def forward(self, input_ids, attention_mask, position_ids, logit_positions, *past):
            from transformers import DynamicCache

            seq = input_ids.shape[1]
            total = attention_mask.shape[1]
            q_pos = torch.arange(seq, device=input_ids.device) + (total - seq)  # (S,)
            k_pos = torch.arange(total, device=input_ids.device)  # (T,)
            causal = k_pos[None, :] <= q_pos[:, None]  # (S, T)
            allowed = causal[None, None, :, :] & attention_mask.bool()[:, None, None, :]  # (B, 1, S, T)
            cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])))
            out = self.model(
                input_ids=input_ids,
                attention_mask=self.masks(allowed, attention_mask, position_ids),
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                logits_to_keep=logit_positions,  # a 1-D tensor: these positions of every row
            )
            presents = []
            for layer in out.cache.layers:
                presents += [layer.keys, layer.values]
            return (out.logits, *presents)

    class ScorerGraph(nn.Module):
        """(input_ids, attention_mask[, token_type_ids]) of pairs -> the classification head's logits (B, L)."""

        def __init__(self, model: nn.Module):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            mask4d = additive_mask(attention_mask.bool()[:, None, None, :])
            return self.model(input_ids=input_ids, attention_mask=mask4d, token_type_ids=token_type_ids).logits

    return EncoderGraph, DecoderGraph, ScorerGraph
