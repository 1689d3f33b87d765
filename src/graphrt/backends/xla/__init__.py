"""The XLA backend (``executor``): one precompiled executable per bucket, with its batch
padding (``batch``), compile accounting (``compile``), on-disk executables
(``executables``), sampler (``sampler``) and mesh sharding (``sharding``)."""
