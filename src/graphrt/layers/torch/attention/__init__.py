"""The attention seam on torch and its kernels: the seam (``backend``: ``AttentionBackend`` and
its phases, the step's tensors and host values, the capture guards), graphrt's paged layer and
reference kernel (``paged``), the one selector (``selector``) and a module per kernel
(``triton_attention``, ``flashinfer_attention``, ``ascend_attention``). docs/attention.md."""
