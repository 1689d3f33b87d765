"""``state_slots``: the recurrent-state slot of each request, prepared and padded like
``slot_mapping`` (docs/hybrid.md), on both host kernels.

* Gathered by row from a per-row table (any integer dtype; default: the row itself); -1 for
  every request of a model without state.
* Refused before anything is written, naming ``state_slots``: a slot outside
  ``[0, num_state_slots)``, one slot for two requests, a table of another length, slots for a
  preparer of a model without state. The compiled and interpreted checks report the same
  (tests/core/test_step_checks.py draws corrupted tables), and the padding rules fill -1
  (tests/core/test_padding.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from graphrt import InputError, InputPreparer
from graphrt.core.inputs.fields import ARRAY_FIELDS

pytestmark = pytest.mark.usefixtures("host_kernel")

TOKENS = np.arange(40, dtype=np.int32).reshape(4, 10) % 30
TABLE = np.arange(1, 13, dtype=np.int32).reshape(4, 3)
STEP = dict(token_ids=TOKENS, block_table=TABLE, req_rows=np.array([2, 0], np.int32),
            num_computed_tokens=np.array([1, 0], np.int32), num_scheduled_tokens=np.array([2, 3], np.int32))


def _prep(host_kernel: str, slots: int | None = 4) -> InputPreparer:
    return InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=4, kernel=host_kernel, num_state_slots=slots)


def test_slots_are_gathered_by_row_and_padded_with_minus_one(host_kernel):
    prep = _prep(host_kernel)
    out = prep.prepare(**STEP, state_slots=np.array([3, 1, 0, 2], np.int64))
    assert out.state_slots.tolist() == [0, 3]
    assert prep.prepare(**STEP).state_slots.tolist() == [2, 0]                 # default: the row itself
    assert _prep(host_kernel, None).prepare(**STEP).state_slots.tolist() == [-1, -1]
    prep.check(**STEP, state_slots=[3, 1, 0, 2])
    padded = prep.write(num_tokens=8, num_reqs=4,
                        out={name: np.full(shape, 99, dtype) for name, shape, dtype in _buffers()})
    assert padded.state_slots.tolist() == [0, 3, -1, -1]


def _buffers():
    from graphrt.core.inputs.fields import FIELD_DTYPES, buffer_shapes
    shapes = buffer_shapes(16, 4, 3)
    return [(name, shapes[name], FIELD_DTYPES[name]) for name in ARRAY_FIELDS]


@pytest.mark.parametrize("slots,message", [
    ([3, 1, 4, 2], r"request 0 \(row 2\) has state slot 4, outside \[0, 4\).*slot 4 is the trash slot"),
    ([3, 1, -1, 2], r"request 0 \(row 2\) has state slot -1, outside \[0, 4\)"),
    ([1, 1, 1, 2], r"state slot 1 is held by two requests of one step \(the second: request 1, row 0\)"),
    ([1, 2, 3], r"3 entries but the tables have 4 rows"),
    ([2**40, 1, 0, 2], r"request 1 \(row 0\) has state slot 1099511627776"),
])
def test_bad_slots_are_refused_naming_the_field(host_kernel, slots, message):
    for call in ("prepare", "check"):
        with pytest.raises(InputError, match=message) as err:
            getattr(_prep(host_kernel), call)(**STEP, state_slots=np.array(slots, np.int64))
        assert err.value.field == "state_slots"


def test_a_model_without_state_takes_no_slots(host_kernel):
    with pytest.raises(InputError, match="keeps no recurrent state") as err:
        _prep(host_kernel, None).prepare(**STEP, state_slots=np.arange(4))
    assert err.value.field == "state_slots"
    with pytest.raises(InputError, match="num_state_slots"):
        InputPreparer(max_num_reqs=4, max_num_tokens=16, block_size=4, num_state_slots=0)


def test_a_refused_slot_writes_nothing(host_kernel):
    prep = _prep(host_kernel)
    first = prep.prepare(**STEP, state_slots=np.array([3, 1, 0, 2])).copy()
    with pytest.raises(InputError):
        prep.prepare(**STEP, state_slots=np.array([3, 1, 3, 2]))      # rows 2 and 0 both in slot 3
    again = prep.prepare(**STEP, state_slots=np.array([3, 1, 0, 2]))
    for name in ARRAY_FIELDS:
        assert np.array_equal(getattr(first, name), getattr(again, name)), name
