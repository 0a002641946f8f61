"""HTTP serving (OpenAI-compatible): not part of this version yet."""
