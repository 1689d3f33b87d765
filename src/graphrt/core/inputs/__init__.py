"""Input preparation: from the engine's tables and a step's schedule to the padded model inputs.

The step's field table (``fields``), the preparer (``preparer``: ``InputPreparer``, which owns
its ``Padder``), the padding rules (``padding``), the host loops written once
(``host_loops``, ``pad_loops``, ``loop_primitives``: compiled by ``host_kernels``, or interpreted
by ``prepare_numpy``), the forms a table is refused or converted in (``forms``), what a failed
check says (``step_codes``), and the per-step extra inputs a model declares (``extra_inputs``).
Numpy (and optionally numba) only.
"""
