"""Prompt data for the trainer: datasets from JSONL/Parquet, chat templates, filtering, resumable sampling.

Every rank loads the same file the same way; a :class:`PromptSampler` (same seed everywhere) picks each
global batch (the trainer hands each data-parallel rank its block of whole prompt groups).
"""

from megatron_gkd.data.config import DataConfig
from megatron_gkd.data.dataset import DatasetStats, PromptDataset, PromptRecord, load_prompts
from megatron_gkd.data.sampler import PromptSampler
from megatron_gkd.data.tokenization import load_tokenizer, resolve_chat_template

__all__ = [
    "DataConfig",
    "DatasetStats",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "load_prompts",
    "load_tokenizer",
    "resolve_chat_template",
]
