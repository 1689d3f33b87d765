"""graphrt's layers: the attention and recurrent-state seams and their kernels.

Above the numpy core and below the models and backends (docs/architecture.md): a model's
attention layers and recurrent mixers call the kernels here; the torch executor runs the
attention seam's phases. ``torch/``: the forward context, ``attention/`` (the seam and a module
per kernel) and ``state/`` (the recurrent state's metadata and kernels); ``jax/``: graphrt's
paged attention, Pallas and the recurrent kernels. Importing this package imports neither torch
nor jax.
"""
