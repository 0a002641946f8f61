"""Export, build and package engines: torch -> ONNX -> backend artifact + manifest.

The one list of what `build-engine` (and `serve MODEL`, which builds on first start) takes: every precision
policy (precision/policy.py) and every backend an engine is built for."""

from trtserve.precision.policy import POLICIES

PRECISIONS = tuple(POLICIES)
# auto: tensorrt where TensorRT and a GPU are found; for encoders and cross-encoders, OpenVINO measured beside
# the ONNX Runtime graph where the openvino package is installed (engine_builder/openvino.py)
BACKENDS = ("auto", "onnxruntime", "tensorrt", "openvino")
