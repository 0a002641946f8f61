"""trtserve: Transformer inference serving with TensorRT engines and an ONNX Runtime CPU default.

Importing the package pulls in no heavy dependency: torch, onnxruntime and TensorRT are
imported inside the functions that need them.
"""

__version__ = "0.1.0"
