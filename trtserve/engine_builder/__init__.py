"""Export, build and package engines: torch -> ONNX -> backend artifact + manifest."""
