"""Recipes: assets and presets the project builds itself (tiny models for CPU runs, the distillation demo)."""
