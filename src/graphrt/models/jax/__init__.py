"""JAX reference models: the functional decoder (``decoder``), its loader (``loader``) and a
flax nnx wrapper (``nnx``)."""
