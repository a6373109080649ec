"""Entry point: python -m temper.reward — gRPC Score, and `rollouts` -> `scored` streaming (--help: the settings)."""

from temper.reward.service import RewardService
from temper.runtime.service import main

if __name__ == "__main__":
    main(RewardService)
