"""GGUF weights kept as their stored blocks: the formats, and modules that compute on them."""
