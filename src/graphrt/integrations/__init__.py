"""Other inference engines on graphrt's graphs, one subpackage or module per engine.

Each imports its engine only when it is itself imported, so ``import graphrt`` never needs one,
and none is a dependency of graphrt: install the engine beside graphrt (docs/engines.md says how,
what runs and what is refused). This is the top layer: an integration may use anything below it
(the runner, the engine, the backends); nothing in graphrt imports it.
"""
