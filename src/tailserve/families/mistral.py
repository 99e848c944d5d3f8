"""Mistral: a Llama decoder whose layers may attend within a sliding window (``sliding_window``,
served up to the window: ``model_features.sliding_window``)."""

from tailserve.families.base import Family

FAMILY = Family("MistralForCausalLM")
