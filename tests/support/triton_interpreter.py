"""Triton's interpreter for the CPU kernel tests (attention/test_triton_attention.py,
hybrid/test_triton_recurrent.py).

The interpreter must be switched on (``TRITON_INTERPRET=1``) before triton is first imported in
the process: ``triton.language`` decorates its helpers when it is imported. tests/conftest.py
imports this module before any test module, so in a pytest run the interpreter is ready for the
whole session (torch._dynamo imports triton later and finds it imported); the variable itself is
put back at once, and the Triton test modules set it only while their own tests run.
"""

from __future__ import annotations

import os
import sys

import torch

#: The oldest triton whose interpreter runs these kernels (3.6's fails on ``range(scalar arg)``).
INTERPRETER_MIN_TRITON = (3, 9)
#: Set in the child pytest that runs the interpreter tests when this process could not.
CHILD_ENV = "GRAPHRT_TRITON_INTERPRETER_CHILD"


def _interpreter_problem() -> str | None:
    """Make Triton's interpreter usable in this process if possible; None when it is, else why not."""
    if torch.cuda.is_available():
        return "a CUDA GPU is present: the kernels run compiled here (the gpu-marked tests)"
    if "triton" not in sys.modules:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton.language decorates its helpers
        try:
            import triton.language  # noqa: F401
        except ImportError as exc:
            return f"triton does not import ({exc})"
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < INTERPRETER_MIN_TRITON:
        return (f"triton {triton.__version__}: the interpreter tests need {'.'.join(map(str, INTERPRETER_MIN_TRITON))}"
                f" or newer (older interpreters cannot loop over a scalar kernel argument with numpy 2)")
    if isinstance(tl.zeros, JITFunction):
        return "triton was imported earlier in this process without TRITON_INTERPRET=1"
    return None


#: Why the interpreter tests cannot run in this process (None: they can).
INTERPRETER_PROBLEM = _interpreter_problem()
