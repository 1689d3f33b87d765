"""The torch side of graphrt's layers: the forward context (``forward_context``), the attention
seam and its kernels (``attention/``), the recurrent state and its kernels (``state/``) and the
interpreted launch of their Triton kernels (``triton_launch``).
Importing this package imports no torch."""
