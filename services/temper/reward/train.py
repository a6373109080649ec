"""Train an outcome / process reward model: ``python -m temper.reward.train --data FILE --base DIR --out DIR``.

``--data`` is JSON lines, as ``temper.reward.dataset`` exports them from what the system produces
(scored groups, sandbox execution traces) or as written by hand; each line is one of

    {"prompt": P, "chosen": C, "rejected": R}                 preference pair
    {"prompt": P, "completion": C, "label": y}                outcome label, y in [0, 1]
    {"prompt": P, "steps": [S1, S2, ...], "step_labels": [y1, y2, ...]}   process labels

The model is a token classifier with one label (a value head over the backbone), started from
``--base``: a causal LM folder (the policy or an SFT checkpoint; the head starts at random) or a
reward model to train further. With r = the head's logit at a segment's last token
(``models.SegmentEncoder``, the encoding the service uses), the loss of a record is

    pair:     -log sigmoid(r_chosen - r_rejected)          (Bradley-Terry)
    outcome:  BCE(sigmoid(r_completion), y)
    process:  mean over steps of BCE(sigmoid(r_step), y_step)

and the loss of a batch the mean over its records. The result is an HF folder the service loads
with ``[reward.rm] dir`` / ``[reward.prm] dir``; ``train_log.json`` beside it holds the loss per epoch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from temper.reward.models import META_FILE, Encoded, SegmentEncoder, head_logits, read_meta
from temper.runtime.jsonl import jsonl_rows


@dataclass
class Example:
    kind: str  # "pair" | "outcome" | "process"
    sequences: list[Encoded]  # pair: [chosen, rejected]; else one
    labels: list[float]  # outcome: [y]; process: one per step; pair: []


def load_records(paths: list[str | Path]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            for _, n, rec in jsonl_rows(f, lambda _, n, e, path=path: SystemExit(f"{path}:{n}: not JSON: {e}")):
                records.append(_checked(rec, f"{path}:{n}"))
    if not records:
        raise SystemExit(f"no records in {[str(p) for p in paths]}")
    return records


def _checked(rec, where: str) -> dict:
    if not isinstance(rec, dict) or not isinstance(rec.get("prompt", ""), str):
        raise SystemExit(f"{where}: a JSON object with a string 'prompt' is required")
    if {"chosen", "rejected"} <= rec.keys():
        ok = isinstance(rec["chosen"], str) and isinstance(rec["rejected"], str)
    elif {"completion", "label"} <= rec.keys():
        ok = isinstance(rec["completion"], str) and isinstance(rec["label"], int | float) and 0 <= rec["label"] <= 1
    elif {"steps", "step_labels"} <= rec.keys():
        ok = (isinstance(rec["steps"], list) and len(rec["steps"]) == len(rec["step_labels"]) > 0
              and all(isinstance(s, str) for s in rec["steps"])
              and all(isinstance(y, int | float) and 0 <= y <= 1 for y in rec["step_labels"]))
    else:
        ok = False
    if not ok:
        raise SystemExit(f"{where}: not a pair (chosen, rejected), an outcome (completion, label in [0, 1]) or a "
                         "process record (steps, step_labels of the same length, in [0, 1])")
    return rec


def encode_records(records: list[dict], encoder: SegmentEncoder) -> tuple[list[Example], int]:
    """Examples, and how many records were skipped (too long for the model)."""
    from temper.reward.models import MalformedSteps, SequenceTooLong

    out, skipped = [], 0
    for rec in records:
        p = rec.get("prompt", "")
        try:
            if "chosen" in rec:
                out.append(Example("pair", [encoder.encode(p, [rec["chosen"]], allow_empty=True),
                                            encoder.encode(p, [rec["rejected"]], allow_empty=True)], []))
            elif "completion" in rec:
                out.append(Example("outcome", [encoder.encode(p, [rec["completion"]], allow_empty=True)],
                                   [float(rec["label"])]))
            else:
                out.append(Example("process", [encoder.encode(p, rec["steps"])], [float(y) for y in rec["step_labels"]]))
        except (SequenceTooLong, MalformedSteps):
            skipped += 1
    return out, skipped


def batch_loss(model, encoder: SegmentEncoder, batch: list[Example]) -> torch.Tensor:
    """Mean loss of ``batch`` (see the module doc), from one padded forward over all its sequences."""
    sequences = [s for ex in batch for s in ex.sequences]
    input_ids, mask = encoder.pad(sequences)
    r = head_logits(model, input_ids, mask)  # [n_sequences, tokens]
    losses, row = [], 0
    for ex in batch:
        if ex.kind == "pair":
            chosen = r[row, ex.sequences[0].positions[-1]]
            rejected = r[row + 1, ex.sequences[1].positions[-1]]
            losses.append(-F.logsigmoid(chosen - rejected))
        else:
            logits = r[row, list(ex.sequences[0].positions)]
            if ex.kind == "outcome":
                logits = logits[-1:]
            losses.append(F.binary_cross_entropy_with_logits(logits, torch.tensor(ex.labels)))
        row += len(ex.sequences)
    return torch.stack(losses).mean()


def train(data: list[str | Path], base: str | Path, out: str | Path, epochs: int = 3, lr: float = 1e-3,
          batch_size: int = 8, seed: int = 0, step_tag: str | None = None, max_tokens: int = 2048,
          log=print) -> dict:
    from transformers import AutoModelForTokenClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    records = load_records(list(data))
    base = Path(base)
    meta = read_meta(base)
    step_tag = step_tag if step_tag is not None else meta.get("step_tag")
    model = AutoModelForTokenClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    positions = getattr(model.config, "max_position_embeddings", None) or max_tokens
    encoder = SegmentEncoder(tokenizer, step_tag, min(max_tokens, positions))
    examples, skipped = encode_records(records, encoder)
    if not examples:
        raise SystemExit("every record is longer than the model takes")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    history = []
    model.train()
    for epoch in range(epochs):
        rng.shuffle(examples)
        t0, total, n = time.monotonic(), 0.0, 0
        for i in range(0, len(examples), batch_size):
            batch = examples[i: i + batch_size]
            loss = batch_loss(model, encoder, batch)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            total += loss.item() * len(batch)
            n += len(batch)
        history.append(total / n)
        log(f"epoch {epoch + 1}/{epochs}: loss {history[-1]:.4f} ({time.monotonic() - t0:.1f}s)")
    model.eval()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    kinds = {k: sum(ex.kind == k for ex in examples) for k in ("pair", "outcome", "process")}
    (out / META_FILE).write_text(json.dumps({"step_tag": step_tag, "trained_from": str(base), "examples": kinds}))
    summary = {"loss_per_epoch": history, "examples": kinds, "skipped": skipped, "out": str(out)}
    (out / "train_log.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m temper.reward.train", description=__doc__.split("\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help="JSON-lines files of pair / outcome / process records")
    ap.add_argument("--base", required=True, help="model folder to start from (causal LM or reward model)")
    ap.add_argument("--out", required=True, help="folder to write the trained reward model to")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-tag", default=None, help="token appended after each step (default: the base's, or none)")
    ap.add_argument("--max-tokens", type=int, default=2048)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    summary = train(args.data, args.base, args.out, args.epochs, args.lr, args.batch_size, args.seed, args.step_tag,
                    args.max_tokens)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
