"""The recurrent state on torch: the state backend beside the attention one (``backend``), the
step's metadata and its reads and writes (``metadata``), and the kernels (``mamba_kernels``,
``gated_delta``, ``triton_recurrent``) chosen once through their registration (``kernels``).
docs/hybrid.md."""
