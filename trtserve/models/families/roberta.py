"""RoBERTa and XLM-RoBERTa encoders (multilingual E5, BGE-M3's encoder): BERT's layout, with position ids
counted from the padding index + 1 over the non-padding tokens (transformers derives them from input_ids
inside the graph) and one token type."""

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family

FAMILY = Family(name="roberta", model_types=("roberta", "xlm-roberta"), kind=ModelKind.ENCODER, norm="layer",
                biases="all", activation="gelu", positions_after_padding=True)
