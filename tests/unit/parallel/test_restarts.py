"""torchrun restarts (``--max-restarts``) are refused at start-up when torchrun shares its rendezvous store with the
ranks: a restarted attempt would read the dead ranks' addresses from it and fail to connect (pytorch#135712; the
e2e test of a restart, ``tests/e2e/trainer/test_rank_restart.py``, failed so before the launcher set the variable)."""

import pytest

from megatron_gkd.parallel.state import RESTART_ENV, check_restartable


@pytest.mark.parametrize("environ", [
    {},  # not under torchrun
    {"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"},  # no restarts: the shared store is fine
    {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False"},  # what RESTART_ENV makes torchrun do
])
def test_runs_that_restart_safely_or_never_pass(environ):
    check_restartable(environ)


def test_restarts_into_the_shared_store_are_refused_with_the_fix_named():
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") as error:
        check_restartable({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert "--max-restarts=1" in str(error.value) and "--max-restarts=0" in str(error.value)
    assert RESTART_ENV == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
