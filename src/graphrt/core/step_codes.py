"""What a step check found: the codes the compiled loops (``host_loops``) and the numpy path
(``prepare_numpy``) both return, and the preparer turns into an
:class:`~graphrt.InputError` naming the field. numpy-free and numba-free, so either side
imports it.

Both paths first clamp every request value (row, computed, scheduled) to the int32 range
(``fields.INDEX_MAX``), then compare and sum in int64: nothing overflows, and a clamped
value fails exactly the checks its true value fails (the tables have fewer than
``INDEX_MAX`` rows and columns). "First maximum" below is over the clamped values.
"""

# In the order the checks are reported; the detail each carries is noted. Codes 1-6 are the
# request-level bounds every loop indexes by (``check_requests``), the rest the step's.
E_OK = 0
E_ROW_OUT_OF_RANGE = 1      # detail: request index
E_SCHEDULED_NOT_POSITIVE = 2  # request index (first minimum)
E_COMPUTED_NEGATIVE = 3     # request index (first minimum)
E_COMPUTED_PAST_TABLE = 4   # request index (first maximum of computed, >= the token table's width)
E_PAST_TOKEN_TABLE = 5      # request index (first maximum of seq_lens)
E_TABLE_TOO_NARROW = 6      # request index (first maximum of seq_lens)
E_ROW_REPEATED = 7          # request index of the second occurrence
E_TOO_MANY_TOKENS = 8       # total tokens
E_NULL_BLOCK = 9            # request index: the first whose attention reads a block id <= 0
E_TOKEN_OUT_OF_VOCAB = 10   # token index in the step
E_BLOCK_OUT_OF_CACHE = 11   # request index: the first whose row holds a block id >= the bound
