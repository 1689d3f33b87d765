"""The XLA backend (``backend``): one precompiled executable per bucket. Its parts: the bucket
grid (``buckets``), the jitted programs (``programs``), the executor (``executor``), what it
builds per key (``entries``), its compile bookkeeping (``compile_ledger``), the random sampler's
host rows (``sampling_rows``), batch pytrees (``batch``), compile accounting (``compile``),
on-disk executables (``executables``), any function compiled per key (``graphs``), the sampler
(``sampler``) and mesh sharding (``sharding``)."""
