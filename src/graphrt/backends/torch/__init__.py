"""The torch backends: one executor (``executor``: staging buffers, KV cache, capture and
replay, piecewise pieces) over a small device-graph API that each device supplies:
``cuda`` (CUDA graphs), ``npu`` (Ascend ACL graphs, with the ``acl`` stream budget),
``cpu`` (the ``recording_graph``) and ``eager`` (no graphs)."""
