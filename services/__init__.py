"""Temper: RL post-training of LLMs as separately deployable services."""
