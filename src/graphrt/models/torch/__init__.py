"""Torch reference models: paged attention (``attention``), the decoder (``decoder``), its
safetensors loader (``loader``), the tensor-parallel layers a sharded decoder is built from
(``parallel``) and LoRA (``lora``)."""
