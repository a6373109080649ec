"""Learned reward models: an outcome reward model (one score per completion) and a process reward
model (one score per reasoning step), served from local folders through one engine code path.

A reward model is an HF transformers folder (config, safetensors, tokenizer) of either

* a ``*ForTokenClassification`` model: a scalar head over every token of a causal backbone
  (a value head). The outcome score is the head at the completion's last token; the process
  scores are the head at the last token of each step. One model can serve both roles;
* a ``*ForSequenceClassification`` model (the usual outcome RM layout): HF pools the head at the
  last non-padding token; outcome only.

Scores are probabilities: sigmoid(head) for one label, softmax(head)[1] for two. Training
(``temper.reward.train``) fits sigmoid(head) with Bradley-Terry and binary cross-entropy losses, so
a score means "probability this completion / step is good".

Encoding (the same for training and serving, ``RewardModelEngine.encode``): the prompt's tokens
(with the tokenizer's special tokens), then each segment's tokens; after each segment the
model folder's ``step_tag`` token, if its ``temper_reward.json`` names one. A segment is the whole
completion (outcome) or one step (process), steps keeping their delimiter, so the segments
concatenate to the completion. The score of a segment is read at its last token.

Dynamic batching (``DynamicBatcher``): requests from concurrent callers wait in one queue; the
engine's thread takes the first and closes the batch when it holds ``max_batch_size`` requests
or ``max_wait_ms`` after the first arrived, whichever comes first, then runs one padded forward
for all. Every request is answered exactly once, with its own rows of that forward.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

import torch

from temper.reward.steps import split_steps  # noqa: F401 - re-exported: the encoding's segments
from temper.runtime.errors import FailedPrecondition
from temper.runtime.logs import get_logger

_log = get_logger(component="reward.models")
META_FILE = "temper_reward.json"
T = TypeVar("T")
R = TypeVar("R")


class SequenceTooLong(ValueError):
    """A (prompt, completion) longer than the model may take: an ERROR component, never truncated silently."""


class MalformedSteps(ValueError):
    """A completion whose steps cannot be scored (no steps, too many, a step with no tokens)."""


@dataclass(frozen=True)
class Encoded:
    ids: tuple[int, ...]
    positions: tuple[int, ...]  # where each segment's score is read (its last token)


@dataclass
class _Pending(Generic[T]):
    item: T
    future: Future
    arrived: float = field(default_factory=time.monotonic)


class DynamicBatcher(Generic[T, R]):
    """Batches requests from concurrent callers into one ``run_batch`` call (see the module doc).

    ``run_batch(items) -> results`` runs on the batcher's own thread, one call at a time, and returns
    one result per item in order; if it raises, every request of that batch gets the exception.
    """

    def __init__(self, run_batch: Callable[[list[T]], list[R]], max_batch_size: int, max_wait_ms: float,
                 name: str = "batcher"):
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._closed = False
        self.batches = 0  # forwards run
        self.requests = 0  # requests answered
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> Future:
        return self.submit_many([item])[0]

    def submit_many(self, items: Sequence[T]) -> list[Future]:
        """Queue ``items`` together (a group's completions land in the same batch when it has room)."""
        if self._closed:
            raise FailedPrecondition("reward model engine is closed")
        pending = [_Pending(item, Future()) for item in items]
        for p in pending:
            self._queue.put(p)
        return [p.future for p in pending]

    def _collect(self, first: _Pending) -> list[_Pending]:
        batch = [first]
        deadline = first.arrived + self.max_wait
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                nxt = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:  # closing: finish this batch, then stop
                self._queue.put(None)
                break
            batch.append(nxt)
        return batch

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = self._collect(first)
            try:
                results = self._run_batch([p.item for p in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} requests")
            except BaseException as e:  # noqa: BLE001 - handed to every caller of this batch
                for p in batch:
                    p.future.set_exception(e)
            else:
                for p, r in zip(batch, results):
                    p.future.set_result(r)
            self.batches += 1
            self.requests += len(batch)

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(30)


class SegmentEncoder:
    """prompt + segments -> token ids and read positions (see the module doc); shared by serving and training."""

    def __init__(self, tokenizer, step_tag: str | None, max_tokens: int):
        self.tokenizer = tokenizer
        self.step_tag_id = tokenizer.convert_tokens_to_ids(step_tag) if step_tag else None
        if self.step_tag_id is not None and self.step_tag_id == tokenizer.unk_token_id and step_tag != tokenizer.unk_token:
            raise FailedPrecondition(f"step_tag {step_tag!r} is not a token of the model's tokenizer")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise FailedPrecondition("the tokenizer has neither a pad nor an eos token")
        self.pad_id = pad
        self.max_tokens = max_tokens

    def encode(self, prompt: str, segments: Sequence[str], allow_empty: bool = False) -> Encoded:
        """Token ids of prompt + segments, and the position of each segment's last token.

        A segment without tokens is MalformedSteps, unless ``allow_empty`` (an empty completion's
        outcome score is then read at the prompt's last token).
        """
        ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"]) if prompt else []
        seg_ids = self.tokenizer(list(segments), add_special_tokens=False)["input_ids"] if segments else []
        positions = []
        for i, seg in enumerate(seg_ids):
            if not seg and self.step_tag_id is None and not (allow_empty and ids):
                raise MalformedSteps(f"step {i} has no tokens")
            ids.extend(seg)
            if self.step_tag_id is not None:
                ids.append(self.step_tag_id)
            positions.append(len(ids) - 1)
        if not positions:
            raise MalformedSteps("no segments")
        if len(ids) > self.max_tokens:
            raise SequenceTooLong(f"{len(ids)} tokens > max_tokens {self.max_tokens}")
        return Encoded(tuple(ids), tuple(positions))

    def pad(self, batch: Sequence[Encoded]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded input ids and attention mask: read positions stay where ``encode`` put them."""
        width = max(len(e.ids) for e in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, e in enumerate(batch):
            input_ids[row, : len(e.ids)] = torch.tensor(e.ids)
            mask[row, : len(e.ids)] = 1
        return input_ids, mask


def head_logits(model, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reward head's log-odds: [batch, tokens] for a token classifier, [batch] for a sequence classifier.

    One label: the logit; two labels: logit[1] - logit[0] (so sigmoid gives softmax[1] either way).
    """
    logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
    return logits[..., 0] if logits.shape[-1] == 1 else logits[..., 1] - logits[..., 0]


class RewardModelEngine:
    """One reward model folder, served by one DynamicBatcher; thread-safe."""

    def __init__(self, model_dir: str | Path, max_batch_size: int = 32, max_wait_ms: float = 5.0,
                 max_tokens: int = 2048, threads: int = 0):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise FailedPrecondition(f"no reward model in {self.model_dir} (config.json missing)")
        if threads:
            torch.set_num_threads(threads)
        config = AutoConfig.from_pretrained(self.model_dir)
        arch = self.architecture = (config.architectures or [""])[0]
        self.per_token = not arch.endswith("ForSequenceClassification")
        if self.per_token and not arch.endswith("ForTokenClassification"):
            raise FailedPrecondition(f"{self.model_dir}: architecture {arch!r} is not a reward model "
                                     "(*ForTokenClassification or *ForSequenceClassification)")
        if config.num_labels not in (1, 2):
            raise FailedPrecondition(f"{self.model_dir}: num_labels = {config.num_labels}; a reward head has 1 or 2")
        cls = AutoModelForTokenClassification if self.per_token else AutoModelForSequenceClassification
        self.model = cls.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.meta = read_meta(self.model_dir)
        positions = getattr(config, "max_position_embeddings", None) or max_tokens
        self.encoder = SegmentEncoder(self.tokenizer, self.meta.get("step_tag"), min(max_tokens, positions))
        self.batcher: DynamicBatcher[Encoded, list[float]] = DynamicBatcher(
            self.forward, max_batch_size, max_wait_ms, name=f"reward-model-{self.model_dir.name}")

    def encode(self, prompt: str, segments: Sequence[str], allow_empty: bool = False) -> Encoded:
        return self.encoder.encode(prompt, segments, allow_empty)

    # -- the forward (direct path; the batcher calls it) ------------------------------------------
    def forward(self, batch: Sequence[Encoded]) -> list[list[float]]:
        """One padded forward over ``batch``; the score at each read position of each sequence."""
        input_ids, mask = self.encoder.pad(batch)
        with torch.inference_mode():
            probs = torch.sigmoid(head_logits(self.model, input_ids, mask))
        if not self.per_token:
            return [[float(probs[row])] for row in range(len(batch))]
        return [probs[row, list(e.positions)].tolist() for row, e in enumerate(batch)]

    # -- served path ------------------------------------------------------------------------------
    def submit(self, encoded: Sequence[Encoded]) -> list[Future]:
        """Futures of the scores (one list per sequence) through the dynamic batcher."""
        return self.batcher.submit_many(encoded)

    def score(self, prompt: str, completion: str) -> float:
        """Outcome score of one completion (convenience: one request through the batcher)."""
        return self.submit([self.encode(prompt, [completion], allow_empty=True)])[0].result()[-1]

    def score_steps(self, prompt: str, steps: Sequence[str]) -> list[float]:
        if not self.per_token:
            raise FailedPrecondition(f"{self.model_dir} is a sequence classifier: it scores outcomes, not steps")
        return self.submit([self.encode(prompt, steps)])[0].result()

    def close(self) -> None:
        self.batcher.close()


def read_meta(model_dir: str | Path) -> dict:
    path = Path(model_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def build_tiny_reward_model(out_dir: str | Path, sequence_classifier: bool = False, hidden_size: int = 64,
                            layers: int = 2, heads: int = 2, seed: int = 0, step_tag: str | None = None) -> Path:
    """A randomly initialised Llama reward model over the tiny tokenizer (tests, benchmarks); no download."""
    from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaForTokenClassification

    from temper.models.tiny import build_tokenizer

    out = Path(out_dir)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        num_labels=1, torch_dtype="float32")
    torch.manual_seed(seed)
    model = (LlamaForSequenceClassification if sequence_classifier else LlamaForTokenClassification)(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / META_FILE).write_text(json.dumps({"step_tag": step_tag}))
    return out
