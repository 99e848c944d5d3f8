"""Observability at the edge: the engine emits plain stats, these modules render them."""
