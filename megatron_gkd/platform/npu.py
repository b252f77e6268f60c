"""Ascend NPU: torch_npu and MindSpeed, imported before Megatron-Core.

MindSpeed (``mindspeed.megatron_adaptor``) patches Megatron-Core at import time (fused kernels, HCCL,
NPU device placement), so it must be imported before ``megatron.core``. Neither package can be installed
from the package index: torch_npu needs the CANN toolkit, and MindSpeed comes from Ascend's own source
(https://gitcode.com/Ascend/MindSpeed). See README "Platforms".
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

MINDSPEED_ADAPTOR = "mindspeed.megatron_adaptor"


def install() -> None:
    """Imports torch_npu and MindSpeed's Megatron adaptor, with actionable errors when they are missing."""
    try:
        importlib.import_module("torch_npu")
    except ImportError as error:
        raise RuntimeError(
            "the npu platform needs torch_npu (with the Ascend CANN toolkit); install the torch_npu "
            "release matching your torch, or choose another platform with MEGATRON_GKD_PLATFORM"
        ) from error
    try:
        importlib.import_module(MINDSPEED_ADAPTOR)
    except ImportError as error:
        raise RuntimeError(
            "the npu platform needs MindSpeed from Ascend's source "
            "(git clone https://gitcode.com/Ascend/MindSpeed && pip install -e MindSpeed); the "
            "'mindspeed' package on the public index is a placeholder"
        ) from error
    logger.info("npu platform: torch_npu and %s imported before Megatron-Core", MINDSPEED_ADAPTOR)
