from trtserve.models.families import Family

FAMILY = Family(name="bert", model_types=("bert",), kind="encoder", norm="layer", biases="all", activation="gelu")
