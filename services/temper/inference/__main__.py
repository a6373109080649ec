"""Entry point: python -m temper.inference [--config FILE] [--model-dir DIR] [--engine vllm|hf] ... (--help)"""

from temper.inference.service import InferenceService
from temper.runtime.service import main

if __name__ == "__main__":
    main(InferenceService)
