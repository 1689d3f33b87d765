"""``make compile-check``'s parts (driver: ``benchmarks/compile_check.py``): what the target
compilers decide, proven on a CPU with no device.

* :mod:`.limits`     -- every target's resource limits in one table, and the checks against them;
* :mod:`.triton_jobs` / :mod:`.triton_part` -- graphrt's Triton kernels at every plan, compiled
  ahead of time for NVIDIA (bundled ptxas) and AMD targets;
* :mod:`.xla_checks` / :mod:`.xla_part` -- graphrt's XLA programs compiled deviceless for TPUs
  (libtpu), their ``memory_analysis()`` asserted;
* :mod:`.export_part` -- the programs exported with ``jax.export`` for cpu / cuda / tpu, reloaded
  and run on CPU;
* :mod:`.report`     -- ``report.md`` / ``report.json`` from the parts' records.

The modules named ``*_part`` need the compile venv (``.venv-compile``: triton, libtpu); the
others are plain Python, tested in ``make test`` (``tests/project/test_compile_check.py``).
"""
