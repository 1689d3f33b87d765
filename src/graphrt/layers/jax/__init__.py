"""The JAX side of graphrt's layers: graphrt's paged attention kernel (``paged_attention``),
Pallas ragged paged attention and the XLA attention choice (``pallas_attention``) and the
recurrent kernels and state metadata (``recurrent``). Importing this package imports no jax."""
