"""Batches of the learner: scored groups -> validated plain tensors -> packed model inputs.

Bad input never reaches the model: ``batch_from_groups`` and ``Batch.validate`` raise
InvalidArgument naming the offending field (the step is skipped and counted by the caller).

A bad sample never stalls a job: before a batch is built, ``screen_groups`` drops whole groups
(a group is the unit of GRPO advantages: a group missing members would shift its baseline) by
this rule, first match wins, and reports each with its reason:
- ``reward_error``: a trajectory's reward status is not OK (unscored or ERROR), or any of its
  reward components has status ERROR;
- ``invalid``: the group is malformed (empty, a completion without tokens, logprobs that do not
  match the tokens or are not finite and <= 0, a non-finite reward, a negative temperature or
  policy version; and, when the advantage estimator reads step rewards, step rewards that are
  not finite or whose count disagrees with ``reward.step_end_chars``, or step ends that are not
  non-decreasing within the completion's text); the detail names the field, as a refused batch did before;
- ``too_long``: a sequence (prompt + completion) is longer than ``max_sequence_tokens`` (the
  model's context by default), so it could not be trained on as sampled;
- ``unknown_adapter``: the group names a LoRA adapter (``RolloutGroup.adapter``) the learner does
  not train (per-domain-group adapters: ``TrainerConfig.lora_adapters``), or names none where the
  learner trains several (every group then trains exactly one of them).
The caller trains on the groups left (and samples again if none are), counts the drops by reason
and logs each with its group id.

Packing: the sequences (prompt + completion) of a micro-batch are laid out in rows of at most
``capacity`` tokens by first-fit decreasing; within a row each sequence has its own position ids
(0, 1, ...) and the model's attention is block-diagonal causal (transformers derives it from the
position ids when no attention mask is given), so a sequence never sees another. Without
packing each sequence gets its own right-padded row and an attention mask. Only the hidden states
at positions that predict a completion token are gathered, so the LM head never runs on prompt
tokens or padding. Shared prompts (``share_prompts``): a micro-batch in which consecutive sequences
have the same prompt (a GRPO group) is laid out as prompt trees instead (``shared_prompt_layout``),
each prompt computed once; one in which no prompt repeats keeps the layout above.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace

import torch

from temper.learner.steps import StepTokens
from temper.runtime.errors import InvalidArgument, require
from temper.v1 import common_pb2


@dataclass
class Batch:
    """Plain tensors of one batch; sequence i = prompts[i] + completions[i]."""

    prompts: list[list[int]]
    completions: list[list[int]]
    old_logprobs: torch.Tensor  # [T] behaviour log p of every completion token, in order (nats)
    temperatures: torch.Tensor  # [B] sampling temperature the logprobs were computed at
    rewards: torch.Tensor  # [B]
    group_index: torch.Tensor  # [B]
    policy_versions: torch.Tensor  # [B] version of the weights that sampled each sequence
    domains: list[str]
    job_id: str
    group_ids: list[str] | None = None  # [G] stable ids of the groups (data position in checkpoints)
    # [G] loss weight of each group (prioritized replay's importance weights), multiplied into its
    # sequences' policy loss; None: 1 for every group
    sample_weights: torch.Tensor | None = None
    # [B] process rewards of each sequence and the index of each step's last completion token
    # (temper.learner.steps); [] for a sequence without step rewards; None: not laid out (the
    # advantage estimator does not read them)
    step_rewards: list[list[float]] | None = None
    step_ends: list[list[int]] | None = None
    # [B] per-domain-group LoRA adapter each sequence trains (its group's ``adapter``); None: one policy
    adapters: list[str] | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """[B] completion tokens per sequence."""
        return torch.tensor([len(c) for c in self.completions], dtype=torch.long)

    def validate(self, vocab_size: int | None = None, context_length: int | None = None) -> None:
        """InvalidArgument naming the field unless every shape agrees and every number is finite."""
        n = len(self.completions)
        require(n > 0, "completions", "empty batch")
        for name, size in [("prompts", len(self.prompts)), ("temperatures", len(self.temperatures)),
                           ("rewards", len(self.rewards)), ("group_index", len(self.group_index)),
                           ("policy_versions", len(self.policy_versions)), ("domains", len(self.domains)),
                           *([("adapters", len(self.adapters))] if self.adapters is not None else [])]:
            require(size == n, name, f"{size} entries for {n} sequences")
        total = 0
        for i, (p, c) in enumerate(zip(self.prompts, self.completions)):
            require(len(p) > 0, f"prompts[{i}]", "empty prompt")
            require(len(c) > 0, f"completions[{i}]", "empty completion")
            if context_length is not None:
                require(len(p) + len(c) <= context_length, f"completions[{i}]",
                        f"{len(p)} + {len(c)} tokens exceed the model's context of {context_length}")
            total += len(c)
        require(self.old_logprobs.numel() == total, "old_logprobs",
                f"{self.old_logprobs.numel()} logprobs for {total} completion tokens")
        for name, values, bad, rule in [
                ("old_logprobs", self.old_logprobs, ~torch.isfinite(self.old_logprobs) | (self.old_logprobs > 0),
                 "finite and <= 0"),
                ("rewards", self.rewards, ~torch.isfinite(self.rewards), "finite"),
                ("temperatures", self.temperatures, ~torch.isfinite(self.temperatures) | (self.temperatures <= 0),
                 "finite and > 0")]:
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                require(False, f"{name}[{i}]", f"is {values[i].item()}; must be {rule}")
        require(bool((self.group_index >= 0).all()), "group_index", "must be >= 0")
        if self.sample_weights is not None:
            groups = int(self.group_index.max()) + 1
            require(len(self.sample_weights) == groups, "sample_weights",
                    f"{len(self.sample_weights)} weights for {groups} groups")
            bad = ~torch.isfinite(self.sample_weights) | (self.sample_weights < 0)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                require(False, f"sample_weights[{i}]", f"is {self.sample_weights[i].item()}; must be finite and >= 0")
        if self.step_rewards is not None:
            require(self.step_ends is not None and len(self.step_ends) == n and len(self.step_rewards) == n,
                    "step_rewards", f"step rewards and ends must be given for each of the {n} sequences")
            for i, (r, e, c) in enumerate(zip(self.step_rewards, self.step_ends, self.completions)):
                require(len(r) == len(e), f"step_ends[{i}]", f"{len(e)} step ends for {len(r)} step rewards")
                require(all(math.isfinite(v) for v in r), f"step_rewards[{i}]", "must be finite")
                require(all(0 <= a <= b < len(c) for a, b in zip(e, e[1:] + e[-1:])), f"step_ends[{i}]",
                        f"must be non-decreasing token indices in [0, {len(c)})")
        if vocab_size is not None:
            for name, seqs in (("prompts", self.prompts), ("completions", self.completions)):
                for i, s in enumerate(seqs):
                    if min(s) < 0 or max(s) >= vocab_size:
                        require(False, f"{name}[{i}]", f"token ids must be in [0, {vocab_size})")

    def subset(self, keep: list[int]) -> Batch:
        """The sequences ``keep`` (in order), groups renumbered 0..G'-1."""
        offsets = [0, *torch.cumsum(self.lengths, 0).tolist()]
        old = torch.cat([self.old_logprobs[offsets[i]:offsets[i + 1]] for i in keep]) if keep else self.old_logprobs[:0]
        idx = torch.tensor(keep, dtype=torch.long)
        _, group_index = torch.unique(self.group_index[idx], return_inverse=True)
        kept_groups = sorted({int(self.group_index[i]) for i in keep})
        return Batch([self.prompts[i] for i in keep], [self.completions[i] for i in keep], old,
                     self.temperatures[idx], self.rewards[idx], group_index, self.policy_versions[idx],
                     [self.domains[i] for i in keep], self.job_id,
                     [self.group_ids[g] for g in kept_groups] if self.group_ids is not None else None,
                     self.sample_weights[kept_groups] if self.sample_weights is not None else None,
                     [self.step_rewards[i] for i in keep] if self.step_rewards is not None else None,
                     [self.step_ends[i] for i in keep] if self.step_ends is not None else None,
                     [self.adapters[i] for i in keep] if self.adapters is not None else None)

    def step_inputs(self) -> dict[str, torch.Tensor | None]:
        """``AdvantageInputs``' step fields (step_rewards, step_seq, step_ends) of this batch."""
        if self.step_rewards is None:
            return {}
        seq = [i for i, r in enumerate(self.step_rewards) for _ in r]
        return {"step_rewards": torch.tensor([v for r in self.step_rewards for v in r], dtype=torch.float32),
                "step_seq": torch.tensor(seq, dtype=torch.long),
                "step_ends": torch.tensor([e for ends in self.step_ends for e in ends], dtype=torch.long)}


DROP_REASONS = ("reward_error", "invalid", "too_long", "unknown_adapter")


@dataclass
class DroppedGroup:
    """A group ``screen_groups`` left out, and why (``reason`` in DROP_REASONS)."""

    index: int  # position in the sampled batch
    group_id: str
    reason: str
    field: str  # the offending field, ``groups[g].trajectories[t].<name>``
    detail: str


def _check_group(g_i: int, group: common_pb2.RolloutGroup, steps: bool = False) -> None:
    """InvalidArgument naming ``groups[g].trajectories[t].<field>`` unless the group is well formed
    (``steps``: its step rewards too, for an estimator that reads them)."""
    require(len(group.trajectories) > 0, f"groups[{g_i}].trajectories", "empty group")
    require(math.isfinite(group.loss_weight) and group.loss_weight >= 0, f"groups[{g_i}].loss_weight",
            f"must be finite and >= 0 (0: unset), got {group.loss_weight}")
    for t_i, t in enumerate(group.trajectories):
        field = f"groups[{g_i}].trajectories[{t_i}]"
        require(len(t.completion_token_ids) > 0, f"{field}.completion_token_ids", "empty completion")
        require(len(t.prompt_token_ids) > 0, f"{field}.prompt_token_ids", "empty prompt")
        require(len(t.completion_logprobs) == len(t.completion_token_ids), f"{field}.completion_logprobs",
                f"{len(t.completion_logprobs)} logprobs for {len(t.completion_token_ids)} tokens")
        require(all(math.isfinite(x) and x <= 0 for x in t.completion_logprobs), f"{field}.completion_logprobs",
                "must be finite and <= 0")
        require(t.reward.status == common_pb2.REWARD_STATUS_OK, f"{field}.reward.status", "reward not OK")
        require(math.isfinite(t.reward.total), f"{field}.reward.total", "NaN or inf")
        require(math.isfinite(t.sampling_temperature) and t.sampling_temperature >= 0,
                f"{field}.sampling_temperature", "must be finite and >= 0")
        require(t.policy_version >= 0, f"{field}.policy_version", "must be >= 0")
        if steps and len(t.reward.step_rewards):
            r = t.reward
            require(len(r.step_end_chars) == len(r.step_rewards), f"{field}.reward.step_end_chars",
                    f"{len(r.step_end_chars)} step ends for {len(r.step_rewards)} step rewards")
            require(all(math.isfinite(v) for v in r.step_rewards), f"{field}.reward.step_rewards", "NaN or inf")
            ends = list(r.step_end_chars)
            require(all(0 <= a <= b for a, b in zip([0, *ends], ends)) and ends[-1] <= len(t.completion_text),
                    f"{field}.reward.step_end_chars",
                    f"must be non-decreasing offsets in [0, {len(t.completion_text)}] (completion_text)")


def _drop_reason(g_i: int, group: common_pb2.RolloutGroup, max_sequence_tokens: int,
                 steps: bool = False, adapters: Collection[str] = ()) -> DroppedGroup | None:
    """The first rule of the module docstring that ``group`` breaks, or None."""
    def dropped(reason: str, field: str, detail: str) -> DroppedGroup:
        return DroppedGroup(g_i, group.group_id, reason, field, detail)

    for t_i, t in enumerate(group.trajectories):
        field = f"groups[{g_i}].trajectories[{t_i}]"
        if t.reward.status != common_pb2.REWARD_STATUS_OK:
            return dropped("reward_error", f"{field}.reward.status",
                           f"reward status {common_pb2.RewardStatus.Name(t.reward.status)}")
        for c_i, c in enumerate(t.reward.components):
            if c.status == common_pb2.REWARD_STATUS_ERROR:
                return dropped("reward_error", f"{field}.reward.components[{c_i}]",
                               f"component {c.name!r} failed: {c.error or 'no message'}")
    try:
        _check_group(g_i, group, steps)
    except InvalidArgument as e:
        return dropped("invalid", e.field or f"groups[{g_i}]", str(e))
    if max_sequence_tokens > 0:
        for t_i, t in enumerate(group.trajectories):
            n = len(t.prompt_token_ids) + len(t.completion_token_ids)
            if n > max_sequence_tokens:
                return dropped("too_long", f"groups[{g_i}].trajectories[{t_i}].completion_token_ids",
                               f"{len(t.prompt_token_ids)} + {len(t.completion_token_ids)} tokens exceed "
                               f"max_sequence_tokens={max_sequence_tokens}")
    if adapters and group.adapter not in adapters:
        return dropped("unknown_adapter", f"groups[{g_i}].adapter",
                       f"adapter {group.adapter!r} is not one the learner trains ({sorted(adapters)})")
    if not adapters and group.adapter:
        return dropped("unknown_adapter", f"groups[{g_i}].adapter",
                       f"adapter {group.adapter!r}: the learner trains one policy (no lora_adapters)")
    return None


def screen_groups(groups: list[common_pb2.RolloutGroup], max_sequence_tokens: int = 0, steps: bool = False,
                  adapters: Collection[str] = ()) -> tuple[list[common_pb2.RolloutGroup], list[DroppedGroup]]:
    """(the groups to train on, in order; the ones dropped by the module docstring's rule); ``steps``:
    the advantage estimator reads step rewards, so their layout is checked too; ``adapters``: the
    per-domain-group adapters the learner trains (empty: one policy)."""
    kept, dropped = [], []
    for g_i, group in enumerate(groups):
        reason = _drop_reason(g_i, group, max_sequence_tokens, steps, adapters)
        if reason is None:
            kept.append(group)
        else:
            dropped.append(reason)
    return kept, dropped


def batch_from_groups(groups: list[common_pb2.RolloutGroup], sample_weights: list[float] | None = None,
                      step_tokens: StepTokens | None = None) -> Batch:
    """Scored groups -> Batch; InvalidArgument naming ``groups[g].trajectories[t].<field>`` if bad
    (all or nothing: ``screen_groups`` first to leave bad groups out instead). ``sample_weights``: one
    loss weight per group (replay's importance weights), or None; each group's own ``loss_weight`` (the
    scheduler's multi-task weight; 0: unset) multiplies into it. ``step_tokens``: lay out each
    trajectory's step rewards, their ends mapped to tokens with it (for estimators that read them)."""
    require(len(groups) > 0, "groups", "empty batch")
    task_weights = [g.loss_weight if g.loss_weight > 0 else 1.0 for g in groups]
    if any(w != 1.0 for w in task_weights):
        sample_weights = [b * w for b, w in zip(sample_weights or [1.0] * len(groups), task_weights)]
    prompts, completions, old, temps, rewards, gidx, versions, domains = [], [], [], [], [], [], [], []
    adapters: list[str] = []
    step_rewards: list[list[float]] | None = None if step_tokens is None else []
    step_ends: list[list[int]] | None = None if step_tokens is None else []
    for g_i, group in enumerate(groups):
        _check_group(g_i, group, steps=step_tokens is not None)
        for t in group.trajectories:
            if step_tokens is not None:
                step_rewards.append(list(t.reward.step_rewards))
                step_ends.append(step_tokens.token_ends(t.completion_token_ids, t.reward.step_end_chars)
                                 if len(t.reward.step_rewards) else [])
            prompts.append(list(t.prompt_token_ids))
            completions.append(list(t.completion_token_ids))
            old.extend(t.completion_logprobs)
            temps.append(t.sampling_temperature if t.sampling_temperature > 0 else 1.0)
            rewards.append(t.reward.total)
            gidx.append(g_i)
            versions.append(t.policy_version)
            domains.append(group.task.domain)
            adapters.append(group.adapter)
    return Batch(prompts, completions, torch.tensor(old), torch.tensor(temps), torch.tensor(rewards, dtype=torch.float32),
                 torch.tensor(gidx), torch.tensor(versions), domains, groups[0].job_id, [g.group_id for g in groups],
                 torch.tensor(sample_weights, dtype=torch.float32) if sample_weights is not None else None,
                 step_rewards, step_ends, adapters if any(adapters) else None)


@dataclass
class ModelInputs:
    """One micro-batch laid out for the model, and where its completion tokens are predicted."""

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor | None  # [R, L] (packed layout)
    attention_mask: torch.Tensor | None  # [R, L] (padded layout)
    rows: torch.Tensor  # [t] row of the position whose hidden state predicts completion token k
    cols: torch.Tensor  # [t] its column
    targets: torch.Tensor  # [t] the completion token ids
    temperatures: torch.Tensor  # [t] per token
    lengths: torch.Tensor  # [b] completion tokens per sequence (for aggregation)
    seqs: slice  # the batch's sequences in this micro-batch
    tokens: slice  # their completion tokens within the batch's [T]
    real_tokens: int  # prompt + completion tokens
    grid_tokens: int  # R * L, what the model computes over
    adapter: str = ""  # the LoRA adapter its sequences train (per-domain-group adapters); "": one policy

    def to(self, device: torch.device) -> ModelInputs:
        """The model's tensors on ``device`` (this object itself when they are there already)."""
        if self.input_ids.device == device:
            return self
        move = {f: getattr(self, f) for f in ("input_ids", "position_ids", "attention_mask", "rows", "cols", "targets",
                                               "temperatures")}
        return replace(self, **{f: None if t is None else t.to(device, non_blocking=True) for f, t in move.items()})


def _first_fit_decreasing(lengths: list[int], capacity: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(row and start column of each item, tokens used per row): longest first, each into the first
    row with room (``capacity`` >= the longest item)."""
    rows_fill: list[int] = []
    placement = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, used in enumerate(rows_fill):
            if used + lengths[i] <= capacity:
                placement[i], rows_fill[r] = (r, used), used + lengths[i]
                break
        else:
            placement[i] = (len(rows_fill), 0)
            rows_fill.append(lengths[i])
    return placement, rows_fill


def layout(prompts: list[list[int]], completions: list[list[int]], temperatures: torch.Tensor, pad_id: int,
           packing: bool, capacity: int = 0, seqs: slice | None = None, tokens: slice | None = None) -> ModelInputs:
    """Rows for the model: packed (first-fit decreasing into rows of at most ``capacity`` tokens, at
    least the longest sequence; 0 = the longest sequence) or one right-padded row per sequence."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    longest = max(lengths)
    if packing:
        # as many rows as ``capacity`` needs, each about total / rows long (plus one sequence of slack
        # for fragmentation), so the last row is not a mostly empty one
        if capacity > longest:
            total = sum(lengths)
            rows_needed = -(-total // capacity)
            capacity = min(capacity, -(-total // rows_needed) + longest)
        placement, rows_fill = _first_fit_decreasing(lengths, max(capacity, longest))
        width = max(rows_fill)
        n_rows = len(rows_fill)
        # no two sequences share a row: nothing to gain, and a plain padding mask is cheaper to build
        packing = n_rows < len(lengths)
    if not packing:
        placement = [(i, 0) for i in range(len(lengths))]
        width, n_rows = longest, len(lengths)
    # every position written once through flat indices: one tensor op per field, not one per sequence
    flat_index: list[int] = []
    tokens_flat: list[int] = []
    positions: list[int] = []
    rows, cols, targets = [], [], []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        r, start = placement[i]
        n = lengths[i]
        base = r * width + start
        flat_index.extend(range(base, base + n))
        tokens_flat.extend(p)
        tokens_flat.extend(c)
        positions.extend(range(n))
        # the hidden state at position k predicts token k + 1
        rows.extend([r] * len(c))
        cols.extend(range(start + len(p) - 1, start + n - 1))
        targets.extend(c)
    index = torch.tensor(flat_index)
    input_ids = torch.full((n_rows * width,), pad_id, dtype=torch.long)
    input_ids[index] = torch.tensor(tokens_flat)
    input_ids = input_ids.view(n_rows, width)
    position_ids = attention_mask = None
    if packing:
        # the unused tail of a row is one more (ignored) sequence with its own positions 0, 1, ...
        position_ids = (torch.arange(n_rows * width) % width).view(n_rows, width)
        for r, used in enumerate(rows_fill):
            position_ids[r, used:] -= used
        position_ids.view(-1)[index] = torch.tensor(positions)
    else:
        attention_mask = torch.zeros(n_rows * width, dtype=torch.long)
        attention_mask[index] = 1
        attention_mask = attention_mask.view(n_rows, width)
    comp_lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    n_comp = int(comp_lengths.sum())
    return ModelInputs(input_ids, position_ids, attention_mask, torch.tensor(rows), torch.tensor(cols),
                       torch.tensor(targets), torch.repeat_interleave(temperatures.float(), comp_lengths), comp_lengths,
                       seqs or slice(0, len(prompts)), tokens or slice(0, n_comp), sum(lengths), n_rows * width)


def _prompt_runs(prompts: list[list[int]]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive sequences with the same prompt (a GRPO group's members)."""
    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            runs.append((start, i))
            start = i
    return runs


def shared_prompt_layout(prompts: list[list[int]], completions: list[list[int]], temperatures: torch.Tensor,
                         pad_id: int, packing: bool, capacity: int = 0, seqs: slice | None = None,
                         tokens: slice | None = None) -> ModelInputs:
    """Rows in which consecutive sequences with the same prompt share one copy of it (a prompt tree).

    A unit is a prompt followed by the completions of its run of sequences, each without its last
    token (it predicts nothing). Position ids restart after the prompt for every completion, and a
    4-D attention mask lets a completion token see the prompt and its own earlier tokens only, so
    each completion is computed exactly as in its own row; completion token 0 of every member is
    predicted by the prompt's last position. A group of k samples of a P-token prompt costs
    P + sum(len - 1) positions instead of k * P + sum(len). Units are packed into rows (first-fit
    decreasing, as ``layout``) or get a row each; the unused tail of a row attends to itself only."""
    runs = _prompt_runs(prompts)
    unit_lengths = [len(prompts[a]) + sum(len(c) - 1 for c in completions[a:b]) for a, b in runs]
    if packing:
        placement, rows_fill = _first_fit_decreasing(unit_lengths, max(capacity, max(unit_lengths)))
    else:
        placement, rows_fill = [(u, 0) for u in range(len(runs))], list(unit_lengths)
    n_rows, width = len(rows_fill), max(rows_fill)
    flat_index, tokens_flat, positions, unit_of, branch_of = [], [], [], [], []
    rows, cols, targets = [], [], []
    for u, (a, b) in enumerate(runs):
        r, start = placement[u]
        p = prompts[a]
        base = r * width + start
        flat_index.extend(range(base, base + unit_lengths[u]))
        tokens_flat.extend(p)
        positions.extend(range(len(p)))
        unit_of.extend([u] * unit_lengths[u])
        branch_of.extend([0] * len(p))
        col = start + len(p)  # column of the next completion's first input token
        for j, c in enumerate(completions[a:b], start=1):
            n_in = len(c) - 1
            tokens_flat.extend(c[:-1])
            positions.extend(range(len(p), len(p) + n_in))
            branch_of.extend([j] * n_in)
            rows.extend([r] * len(c))
            cols.append(start + len(p) - 1)
            cols.extend(range(col, col + n_in))
            targets.extend(c)
            col += n_in
    index = torch.tensor(flat_index)
    grid = n_rows * width
    input_ids = torch.full((grid,), pad_id, dtype=torch.long)
    input_ids[index] = torch.tensor(tokens_flat)
    position_ids = torch.zeros(grid, dtype=torch.long)
    position_ids[index] = torch.tensor(positions)
    # unused positions: a unit of their own each (negative ids), so every query row sees at least itself
    unit = -1 - torch.arange(grid)
    unit[index] = torch.tensor(unit_of)
    branch = torch.zeros(grid, dtype=torch.long)
    branch[index] = torch.tensor(branch_of)
    unit, branch = unit.view(n_rows, width), branch.view(n_rows, width)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = ((unit[:, :, None] == unit[:, None, :]) & causal
            & ((branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])))
    comp_lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    n_comp = int(comp_lengths.sum())
    return ModelInputs(input_ids.view(n_rows, width), position_ids.view(n_rows, width), mask[:, None],
                       torch.tensor(rows), torch.tensor(cols), torch.tensor(targets),
                       torch.repeat_interleave(temperatures.float(), comp_lengths), comp_lengths,
                       seqs or slice(0, len(prompts)), tokens or slice(0, n_comp), sum(unit_lengths), grid)


def micro_batches(batch: Batch, pad_id: int, packing: bool, pack_length: int, micro_batch_tokens: int,
                  share_prompts: bool = False) -> list[ModelInputs]:
    """Split ``batch`` into consecutive micro-batches of at most ``micro_batch_tokens`` real tokens
    (0 = one micro-batch; a sequence longer than the budget gets a micro-batch of its own).
    ``share_prompts``: sequences with the same prompt share one copy of it (``shared_prompt_layout``);
    the budget then counts a prompt once per micro-batch. A micro-batch never holds sequences of two
    LoRA adapters (``batch.adapters``): one forward runs one adapter."""
    adapters = batch.adapters

    def cost(i: int, start: int) -> int:
        p, c = batch.prompts[i], batch.completions[i]
        if not share_prompts:
            return len(p) + len(c)
        return len(c) - 1 + (len(p) if i == start or batch.prompts[i - 1] != p else 0)

    bounds, start, used = [], 0, 0
    for i in range(len(batch.prompts)):
        n = cost(i, start)
        new_adapter = adapters is not None and i > start and adapters[i] != adapters[i - 1]
        if i > start and (new_adapter or (micro_batch_tokens > 0 and used + n > micro_batch_tokens)):
            bounds.append((start, i))
            start, used = i, 0
            n = cost(i, start)
        used += n
    bounds.append((start, len(batch.prompts)))
    offsets = [0, *torch.cumsum(batch.lengths, 0).tolist()]
    out = []
    for a, b in bounds:
        # a micro-batch in which no two sequences share a prompt gains nothing from a prompt tree, and
        # its custom mask would cost an L x L tensor per row: the plain layout then
        shared = share_prompts and len(_prompt_runs(batch.prompts[a:b])) < b - a
        lay = shared_prompt_layout if shared else layout
        mb = lay(batch.prompts[a:b], batch.completions[a:b], batch.temperatures[a:b], pad_id, packing,
                 pack_length, slice(a, b), slice(offsets[a], offsets[b]))
        out.append(replace(mb, adapter=adapters[a]) if adapters is not None else mb)
    return out
