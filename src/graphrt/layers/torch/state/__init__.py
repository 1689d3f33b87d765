"""The recurrent state on torch: the step's metadata and its reads and writes (``metadata``) and
the kernels (``mamba_kernels``, ``gated_delta``, ``triton_recurrent``). docs/hybrid.md."""
