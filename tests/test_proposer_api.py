import pytest

import numpy as np

from mtp_cupy.speculative import mtp_rows_to_trim
from mtp_cupy.speculative.proposer import mtp_rows_to_trim_batch


@pytest.mark.parametrize("refeed", [False, True])
def test_rows_to_trim_rules(refeed):
    for k in range(0, 9):
        for a in range(0, k + 1):
            n = mtp_rows_to_trim(k, a, refeed)
            assert 0 <= n <= k
            expect = (k - a) + (max(a - 1, 0) if refeed else 0)
            assert n == min(expect, k)
    d, a = np.array([(k, a) for k in range(9) for a in range(k + 1)]).T   # the batch form, every checked pair
    assert mtp_rows_to_trim_batch(d, a, refeed).tolist() == [mtp_rows_to_trim(x, y, refeed) for x, y in zip(d, a)]
    assert mtp_rows_to_trim(3, 5) == 0          # more accepted than drafted never trims below zero
    with pytest.raises(ValueError):
        mtp_rows_to_trim(-1, 0)
