"""Torch reference models: paged attention (``attention``), the decoder (``decoder``) and
its safetensors loader (``loader``)."""
