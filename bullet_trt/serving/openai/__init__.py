"""An OpenAI-compatible HTTP API in front of the Triton model, in its own process."""
