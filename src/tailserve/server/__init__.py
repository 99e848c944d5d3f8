"""The OpenAI-compatible HTTP server (``tailserve serve``)."""
