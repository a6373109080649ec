"""Reward models: served scores equal a direct forward pass of the same model; dynamic batching."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

from temper.reward.models import (
    DynamicBatcher,
    MalformedSteps,
    RewardModelEngine,
    SequenceTooLong,
    build_tiny_reward_model,
    split_steps,
)

PROMPTS = ["copy 1 2 3", "next 4 5 6", "7 + 1", "copy 9 9 9", "next 0 1 2", "2 + 2"]
COMPLETIONS = ["3", "7 7", "8 = 8", "9 9 9 copy", "3 + 4 - 5 = 2", ""]


def direct(model_dir, prompt: str, segments: list[str], sequence_classifier=False, step_tag_id=None) -> list[float]:
    """The model alone: one unpadded forward of prompt + segments, sigmoid of the head at each segment's end."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    cls = AutoModelForSequenceClassification if sequence_classifier else AutoModelForTokenClassification
    model = cls.from_pretrained(model_dir).eval()
    ids = tok(prompt)["input_ids"]
    ends = []
    for s in segments:
        ids += tok(s, add_special_tokens=False)["input_ids"]
        if step_tag_id is not None:
            ids.append(step_tag_id)
        ends.append(len(ids) - 1)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    if sequence_classifier:
        return [torch.sigmoid(logits[0]).item()]
    return torch.sigmoid(logits[ends, 0]).tolist()


def test_outcome_scores_equal_a_direct_forward(tiny_rm_dir):
    engine = RewardModelEngine(tiny_rm_dir, max_batch_size=8, max_wait_ms=20)
    try:
        # all at once from concurrent callers: they share padded forwards
        results: dict[int, float] = {}

        def call(i):
            results[i] = engine.score(PROMPTS[i], COMPLETIONS[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.batcher.batches < len(PROMPTS)  # batched, not one forward each
        for i in range(len(PROMPTS)):
            # (an empty completion is read at the prompt's last token)
            assert results[i] == pytest.approx(direct(tiny_rm_dir, PROMPTS[i], [COMPLETIONS[i]])[-1], abs=1e-5)
        scores = {round(v, 6) for v in results.values()}
        assert len(scores) > 1  # a real model: different inputs, different scores
    finally:
        engine.close()


def test_process_scores_equal_a_direct_forward(tmp_path):
    d = build_tiny_reward_model(tmp_path / "prm", seed=2, step_tag="?")
    engine = RewardModelEngine(d, max_batch_size=4, max_wait_ms=5)
    try:
        completion = "1 + 2 = 3\n\n3 + 4 = 7\n\n\n\n7 = 7"
        steps = split_steps(completion, "\n\n")
        assert steps == ["1 + 2 = 3", "\n\n3 + 4 = 7", "\n\n\n\n7 = 7"] and "".join(steps) == completion
        served = engine.score_steps("add 1 2 4", steps)
        tag = engine.tokenizer.convert_tokens_to_ids("?")
        assert served == pytest.approx(direct(d, "add 1 2 4", steps, step_tag_id=tag), abs=1e-5)
        assert len(served) == 3 and len({round(v, 6) for v in served}) == 3
    finally:
        engine.close()


def test_sequence_classifier_outcome_model(tmp_path):
    d = build_tiny_reward_model(tmp_path / "seqrm", sequence_classifier=True, seed=3)
    engine = RewardModelEngine(d, max_batch_size=4, max_wait_ms=5)
    try:
        futures = engine.submit([engine.encode(p, [c], allow_empty=True) for p, c in zip(PROMPTS, COMPLETIONS)])
        for p, c, f in zip(PROMPTS, COMPLETIONS, futures):
            assert f.result()[0] == pytest.approx(direct(d, p, [c], sequence_classifier=True)[0], abs=1e-5)
        with pytest.raises(Exception, match="scores outcomes, not steps"):
            engine.score_steps("copy 1 2 3", ["3"])
    finally:
        engine.close()


def test_bounds_and_malformed_steps(tiny_rm_dir):
    engine = RewardModelEngine(tiny_rm_dir, max_tokens=16)
    try:
        with pytest.raises(SequenceTooLong, match="> max_tokens 16"):
            engine.encode("copy 1 2 3", ["1 " * 20])
        with pytest.raises(MalformedSteps):
            engine.encode("copy 1 2 3", ["1", "   ", "2"])  # a step with no tokens
        with pytest.raises(MalformedSteps):
            engine.encode("", [""], allow_empty=True)  # nothing at all to read
        assert engine.encode("copy 1", [""], allow_empty=True).positions == (1,)
    finally:
        engine.close()
    with pytest.raises(Exception, match="config.json missing"):
        RewardModelEngine(tiny_rm_dir / "nope")


def test_dynamic_batcher_bounds_the_wait_and_the_batch():
    sizes: list[int] = []

    def run(items):
        sizes.append(len(items))
        return [x * 2 for x in items]

    b = DynamicBatcher(run, max_batch_size=4, max_wait_ms=50)
    try:
        # a lone request is answered after about max_wait, not held for company
        t0 = time.monotonic()
        assert b.submit(21).result(5) == 42
        assert 0.04 <= time.monotonic() - t0 < 1.0
        # ten queued at once: batches of at most 4, every request answered with its own result
        futures = b.submit_many(list(range(10)))
        assert [f.result(5) for f in futures] == [x * 2 for x in range(10)]
        assert sizes[1:] == [4, 4, 2]
    finally:
        b.close()


def test_dynamic_batcher_hands_a_failed_batch_to_each_caller():
    def run(items):
        if 13 in items:
            raise ValueError("bad batch")
        return items

    b = DynamicBatcher(run, max_batch_size=8, max_wait_ms=20)
    try:
        futures = b.submit_many([1, 13, 2])
        for f in futures:
            with pytest.raises(ValueError, match="bad batch"):
                f.result(5)
        assert b.submit(5).result(5) == 5  # the batcher keeps serving
    finally:
        b.close()
