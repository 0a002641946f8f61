"""The torch fp32 reference of a decoder's fidelity report, computed before the engine is loaded and kept small.

The reference model is as large as the engine it judges. Holding both would double a build's memory, so every
input of a report is run through the reference first, keeping only what the comparison needs: each input's final
hidden states (B, S, hidden) and the greedy continuation's tokens and logits. Then the model is released but for
its LM head, which turns a chunk of positions of those hidden states into logits while the engine computes the
same chunk. Results are keyed by the input's ids and mask, so a build that measures several tries computes each
reference once.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from trtserve.memory import return_freed_memory
from trtserve.precision.measure import DECODE_STEPS
from trtserve.runtime.generate import positions_from_mask

if TYPE_CHECKING:
    import torch


def _key(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(str((array.shape, array.dtype.str)).encode() + np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


class Reference:
    """`load()` gives the torch model (fp32, eval mode, eager attention)."""

    _head: _KeptHead | None  # the LM head, kept while the model is released

    def __init__(self, load: Callable):
        self._load, self._model = load, None
        self._head, self._cap = None, None
        self._hidden: dict[str, torch.Tensor] = {}  # key -> (B, S, hidden) torch tensor
        self._decoded: dict[str, tuple] = {}  # key -> (tokens (B, steps), logits (B, steps, V))

    @property
    def model(self):
        """The whole model (loaded again where it was released)."""
        if self._model is None:
            self._model = self._load()
            self._head = None
        return self._model

    def prepare(self, inputs, decode_ids: np.ndarray | None = None, pad_id: int = 0) -> None:
        """Run the reference on each (ids, mask) of `inputs` and, with `decode_ids`, its greedy continuation, where
        not already done; then release all of the model but its LM head."""
        import torch

        for ids, mask in inputs:
            key = _key(ids, mask)
            if key not in self._hidden:
                with torch.inference_mode():
                    self._hidden[key] = self.model.get_decoder()(
                        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(positions_from_mask(mask))).last_hidden_state
        if decode_ids is not None and _key(decode_ids) not in self._decoded:
            self._decoded[_key(decode_ids)] = self._greedy(decode_ids, pad_id)
        self.release()

    def _greedy(self, ids: np.ndarray, pad_id: int) -> tuple:
        """HF `generate` (greedy, its own KV cache) from (B, P) ids: (tokens (B, steps), logits (B, steps, V))."""
        import torch

        with torch.inference_mode():
            out = self.model.generate(
                input_ids=torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids)),
                max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=pad_id)
        return out.sequences[:, ids.shape[1]:].numpy(), torch.stack(out.logits, 1).numpy()

    def release(self) -> None:
        """Drop the model but its LM head (and the final soft cap some families apply after it)."""
        if self._model is None:
            return
        self._head = _KeptHead.of(self._model.get_output_embeddings())
        self._cap = getattr(self._model.config, "final_logit_softcapping", None)
        self._model = None
        gc.collect()
        return_freed_memory()

    def logits(self, ids: np.ndarray, mask: np.ndarray, start: int, end: int) -> np.ndarray:
        """(B, end - start, V) reference logits at positions start..end of a prepared input."""
        hidden = self._hidden[_key(ids, mask)][:, start:end]
        if self._model is None:
            assert self._head is not None  # kept when the model was released
            return self._head(hidden, self._cap)
        return _KeptHead(module=self._model.get_output_embeddings())(
            hidden, getattr(self._model.config, "final_logit_softcapping", None))

    def decoded(self, ids: np.ndarray) -> tuple:
        return self._decoded[_key(ids)]


class _KeptHead:
    """An LM head kept after its model was released. A linear head keeps its weight in bfloat16 where that holds
    every value exactly (a checkpoint stored in bf16 and upcast at load: half the memory, the same logits) and is
    applied a block of vocabulary rows at a time in fp32; any other head is kept as its module."""

    ROWS = 16384  # vocabulary rows upcast at a time

    def __init__(self, weight=None, bias=None, module=None):
        self.weight, self.bias, self.module = weight, bias, module

    @classmethod
    def of(cls, head) -> _KeptHead:
        import torch

        if not isinstance(head, torch.nn.Linear) or head.weight.dtype != torch.float32:
            return cls(module=head)
        weight = head.weight.detach()
        exact = all(torch.equal(block.to(torch.bfloat16).float(), block) for block in weight.split(cls.ROWS))
        return cls(weight.to(torch.bfloat16) if exact else weight, None if head.bias is None else head.bias.detach())

    def __call__(self, hidden, cap: float | None) -> np.ndarray:
        """Logits (fp32 numpy) of `hidden`, soft-capped where `cap` is set."""
        import torch

        def capped(logits):
            return torch.tanh(logits / cap) * cap if cap else logits

        with torch.inference_mode():
            if self.module is not None:
                return capped(self.module(hidden)).float().numpy()
            out = np.empty((*hidden.shape[:-1], self.weight.shape[0]), np.float32)
            for first in range(0, self.weight.shape[0], self.ROWS):
                rows = slice(first, first + self.ROWS)
                bias = None if self.bias is None else self.bias[rows]
                out[..., rows] = capped(torch.nn.functional.linear(hidden, self.weight[rows].float(), bias)).numpy()
            return out
