"""Transfer state machine: RESERVED -> TRANSFERRING -> COMMITTED, or FAILED; never backwards."""
import itertools

import pytest

from kvtransport.state import IllegalTransition, TransferState as S

ALLOWED = {(S.RESERVED, S.TRANSFERRING), (S.RESERVED, S.FAILED),
           (S.TRANSFERRING, S.COMMITTED), (S.TRANSFERRING, S.FAILED)}


@pytest.mark.parametrize("src, dst", list(itertools.product(S, S)))
def test_only_forward_transitions(src, dst):
    """Exactly the four forward transitions are legal; all others raise IllegalTransition."""
    if (src, dst) in ALLOWED:
        assert src.advance(dst) is dst
    else:
        with pytest.raises(IllegalTransition):
            src.advance(dst)


def test_final_states():
    """COMMITTED and FAILED are final; the others are not."""
    assert [s for s in S if s.is_final] == [S.COMMITTED, S.FAILED]
