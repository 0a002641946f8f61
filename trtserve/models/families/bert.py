from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.families import Family

FAMILY = Family(name="bert", model_types=("bert",), kind=ModelKind.ENCODER, norm="layer", biases="all",
                activation="gelu")
