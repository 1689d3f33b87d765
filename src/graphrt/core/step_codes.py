"""What a step check found: the codes the compiled loops (``host_loops``) and the numpy path
(``prepare_numpy``) both return, and the preparer turns into an
:class:`~graphrt.InputError` naming the field. numpy-free and numba-free, so either side
imports it."""

# In the order the checks are reported; the detail each carries is noted. Codes 1-5 are the
# request-level bounds every loop indexes by (``check_requests``), the rest the step's.
E_OK = 0
E_ROW_OUT_OF_RANGE = 1      # detail: request index
E_SCHEDULED_NOT_POSITIVE = 2  # request index (first minimum)
E_COMPUTED_NEGATIVE = 3     # request index (first minimum)
E_PAST_TOKEN_TABLE = 4      # request index (first maximum of seq_lens)
E_TABLE_TOO_NARROW = 5      # request index (first maximum of seq_lens)
E_ROW_REPEATED = 6          # request index of the second occurrence
E_TOO_MANY_TOKENS = 7       # total tokens
E_NULL_BLOCK = 8            # token index in the step
E_TOKEN_OUT_OF_VOCAB = 9    # token index in the step
E_BLOCK_OUT_OF_CACHE = 10   # largest block id in the scheduled rows
