"""``local`` client weight offload: accepted and inert on the cpu platform, with a warning (STYLE 13)."""

import torch

from megatron_gkd.teacher.clients.local import WeightOffload


def test_offload_is_inert_on_cpu_and_says_so(caplog):
    model = torch.nn.Linear(4, 3)
    before = [tensor.data_ptr() for tensor in model.parameters()]
    with caplog.at_level("WARNING"):
        offload = WeightOffload([model], enabled=True)
    assert not offload.active
    assert "offload has no effect on the 'cpu' platform" in caplog.text
    offload.to_host()
    offload.to_device()
    assert [tensor.data_ptr() for tensor in model.parameters()] == before


def test_offload_off_warns_nothing(caplog):
    with caplog.at_level("WARNING"):
        offload = WeightOffload([torch.nn.Linear(4, 3)], enabled=False)
    assert not offload.active and "offload" not in caplog.text
