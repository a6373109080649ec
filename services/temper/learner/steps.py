"""Where each reasoning step ends in a completion's tokens: ``Reward.step_end_chars`` -> token indices.

The reward service splits a completion's text into steps and reports where each ends as an offset
into ``completion_text`` (temper.reward.steps); the learner trains on tokens. With the policy's
tokenizer, token k covers the text up to ``len(decode(ids[:k + 1]))`` (special tokens skipped, as
the inference engines decode), so a step that ends at character c ends at the first token whose
decoded prefix reaches c. The last step always ends at the completion's last token: tokens the
text does not show (EOS, a stop string cut from the text) belong to the final step, so every
token lies in exactly one step. Ends are non-decreasing; two steps may end at the same token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from temper.runtime.errors import FailedPrecondition


class StepTokens:
    """Maps step ends in characters to token indices with the policy's tokenizer (see the module doc)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> StepTokens:
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(str(model_dir)))
        except (OSError, ValueError) as e:
            raise FailedPrecondition(f"{model_dir} has no tokenizer the learner can load; step-reward advantages "
                                     f"map step ends to tokens with it: {e}", field="model_dir") from e

    def token_ends(self, token_ids: Sequence[int], char_ends: Sequence[int]) -> list[int]:
        """The index in ``token_ids`` of each step's last token (``char_ends``: non-decreasing offsets)."""
        n = len(token_ids)
        covered: dict[int, int] = {}

        def chars(k: int) -> int:  # characters the first k tokens decode to
            if k not in covered:
                covered[k] = len(self.tokenizer.decode(list(token_ids[:k]), skip_special_tokens=True))
            return covered[k]

        out, low = [], 1
        for c in char_ends:
            lo, hi = low, n  # smallest k in [lo, n] with chars(k) >= c (n if none)
            while lo < hi:
                mid = (lo + hi) // 2
                if chars(mid) >= c:
                    hi = mid
                else:
                    lo = mid + 1
            out.append(lo - 1)
            low = lo
        if out:
            out[-1] = n - 1
        return out
