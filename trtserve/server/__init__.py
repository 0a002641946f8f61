"""OpenAI-compatible HTTP serving: FastAPI app over a dynamically batched backend."""
