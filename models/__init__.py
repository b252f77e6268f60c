"""Megatron-Core model providers per Hugging Face architecture and the HF <-> Megatron mapping."""
