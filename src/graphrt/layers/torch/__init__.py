"""The torch side of graphrt's layers: the forward context (``forward_context``), the attention
seam and its kernels (``attention/``) and the recurrent state and its kernels (``state/``).
Importing this package imports no torch."""
