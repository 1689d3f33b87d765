"""The engine's persistent step tables: token ids and block ids per request row."""

from __future__ import annotations

import numpy as np

from graphrt.engine.scheduler import ScheduledStep


def write_step_tables(token_table: np.ndarray, block_table: np.ndarray, step: ScheduledStep) -> None:
    """Write what the persistent tables lack for ``step``: new token ids and new blocks.

    Rows persist between steps, so a decode step writes one token per request, and a row
    freshly (re)assigned to a request is cleared once. A request admitted with a cached
    prefix gets its shared blocks written like its own (the runner only reads them).
    """
    for req, n in zip(step.requests, step.num_scheduled):
        row = req.row
        end = req.num_computed_tokens + n
        if req.tokens_in_row < end:
            token_table[row, req.tokens_in_row:end] = req.tokens(req.tokens_in_row, end)
            req.tokens_in_row = end
        if req.blocks_in_row < len(req.blocks):
            if req.blocks_in_row == 0:
                block_table[row] = 0
            block_table[row, req.blocks_in_row:len(req.blocks)] = req.blocks[req.blocks_in_row:]
            req.blocks_in_row = len(req.blocks)
