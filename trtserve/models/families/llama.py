"""Llama 2/3.x and the checkpoints that share its layout (SmolLM2, TinyLlama): the reference decoder.
Llama 3.1/3.2 scale the rotary frequencies (`llama3`); `linear` and `dynamic` scaling are transformers' own
(dynamic changes nothing up to max_position_embeddings, which bounds an engine's length)."""

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family

FAMILY = Family(name="llama", model_types=("llama",), kind=ModelKind.DECODER,
                rope_types=("default", "llama3", "linear", "dynamic"))
