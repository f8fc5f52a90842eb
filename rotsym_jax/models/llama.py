"""Placeholder: replaced by the real LLAMA family module."""

from .family import Family

LLAMA = Family(name="llama", model_types=(), build=None, tensors=None, detect=None, architecture=None)
