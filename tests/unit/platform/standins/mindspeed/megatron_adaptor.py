"""A stand-in for ``mindspeed.megatron_adaptor`` (tests only).

Like the real adaptor it must be imported before Megatron-Core (it fails otherwise), imports torch_npu,
reads its options once from the command line (:func:`mindspeed.args_utils.get_mindspeed_args`) and then
patches Megatron-Core for the device. The stand-in's NPU is the host, so its patches are the ones that make
Megatron-Core run on the host: megatron-gkd's CPU adaptor. The import is recorded with the options read.
"""

import sys

_MEGATRON_FIRST = sorted(name for name in sys.modules if name == "megatron.core" or name.startswith("megatron.core."))

from torch_npu._standin import record  # noqa: E402

from mindspeed.args_utils import get_mindspeed_args  # noqa: E402

ARGS = get_mindspeed_args()
record("mindspeed_adaptor", megatron_imported_before=_MEGATRON_FIRST, args=vars(ARGS), argv=list(sys.argv))
if _MEGATRON_FIRST:
    raise AssertionError(f"Megatron-Core was imported before MindSpeed: {_MEGATRON_FIRST[:3]}")

from megatron_gkd.platform import cpu_adaptor  # noqa: E402

cpu_adaptor.install()
