"""What the reward service is configured with: the ``[reward]`` table, validated at start-up.

Domains map to composite rewards. ``[reward.domains.NAME]`` applies to the domain NAME and to
every domain below it (``math`` covers ``math.linear``); the longest matching name wins. Its
``weights`` name the components and their weights in the total:

* verifier components (``exact_answer``, ``chain_final``, ``math``, ``code.all_pass``, ``code.pass_fraction``,
  ``reasoning_gym``, ``format.*``; see ``temper.reward.verifiers``),
* ``rm``: the outcome reward model's score of (prompt, completion), in [0, 1],
* ``prm``: the process reward model's step scores, aggregated by ``prm_aggregation``,
* ``exact_steps``: a rule-based process verifier, each step against the reference's step
  (``temper.reward.verifiers.basic.ExactSteps``); like ``prm`` it gives ``step_rewards``,
* ``length_penalty``: DAPO's overlong penalty (``length_penalty`` below), in [-1, 0],
* ``safety``: 1 if the completion refuses exactly when the task is flagged
  (``task.metadata["safety"] = "refuse"``), else 0. A flagged prompt always gets it (weight 1
  unless the domain names one) and skips the verifiers that check an answer.

A component with weight 0 is still computed and kept in the scored message (visible to the
monitor), it only does not count in the total.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from temper.runtime.config import address_of

MODEL_COMPONENTS = ("rm", "prm", "length_penalty", "safety")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LengthPenalty(_Strict):
    """DAPO's soft overlong punishment, over completion tokens L, with L_max = max_tokens, B = buffer_tokens:
    0 if L <= L_max - B; (L_max - B - L) / B if L_max - B < L <= L_max; -1 beyond L_max."""

    max_tokens: int = Field(gt=0)
    buffer_tokens: int = Field(gt=0)

    @model_validator(mode="after")
    def _buffer_fits(self) -> LengthPenalty:
        if self.buffer_tokens > self.max_tokens:
            raise ValueError(f"buffer_tokens ({self.buffer_tokens}) > max_tokens ({self.max_tokens})")
        return self


class DomainSpec(_Strict):
    weights: dict[str, float]
    prm_aggregation: Literal["min", "mean", "last"] = "min"
    length_penalty: LengthPenalty | None = None
    # where this domain's completions split into reasoning steps (the PRM and step verifiers such as
    # exact_steps); "": the service's prm_step_delimiter
    step_delimiter: str = ""

    @model_validator(mode="after")
    def _penalty_configured(self) -> DomainSpec:
        if "length_penalty" in self.weights and self.length_penalty is None:
            raise ValueError("weights names length_penalty but no length_penalty table is given")
        return self


def default_domains() -> dict[str, DomainSpec]:
    return {
        "toy": DomainSpec(weights={"exact_answer": 1.0}),
        "math": DomainSpec(weights={"math": 1.0, "format.boxed": 0.0}),
        "code": DomainSpec(weights={"code.all_pass": 1.0, "code.pass_fraction": 0.0, "format.code_block": 0.0}),
        # multi-step chains (temper.tasks.chain): one step per line; exact_steps kept for the record (weight 0)
        "chain": DomainSpec(weights={"chain_final": 1.0, "exact_steps": 0.0}, step_delimiter="\n"),
        "rg": DomainSpec(weights={"reasoning_gym": 1.0, "format.answer_tag": 0.0}),
        # a dataset's rows (temper.tasks.data) name their verifier in task.metadata["verifier"], which replaces
        # these verifier weights (a [reward.domains."data.NAME"] table's rm / prm / length_penalty / safety stay)
        "data": DomainSpec(weights={"exact_answer": 1.0}),
    }


class MathOptions(_Strict):
    # where the answer is: "boxed" = the last \boxed{}; "answer_tag" = <answer>...</answer>;
    # "auto" = math-verify's own extraction over the whole completion
    answer_format: Literal["boxed", "answer_tag", "auto"] = "boxed"
    workers: int = Field(default=1, ge=1)  # math-verify worker processes (sympy can hang: they time out)
    timeout_seconds: int = Field(default=5, ge=1)  # per parse and per comparison, inside the worker
    hard_timeout_seconds: float = Field(default=20.0, gt=0)  # per answer; past it the worker is killed (C-level hangs)
    max_answer_chars: int = Field(default=1000, ge=1)  # a longer extracted answer scores 0 unparsed


class CodeOptions(_Strict):
    default_language: str = "python3"  # when the task's test spec names none
    require_code_block: bool = True  # False: a completion without a fenced block is run as a whole
    wall_seconds: float = 0  # per test; 0: the sandbox's default (a task's spec may set its own)
    max_tests: int = Field(default=256, ge=1)
    concurrency: int = Field(default=4, ge=1)  # RunTests calls in flight per group
    # 0: one RunTests call per distinct program; N: the group's distinct programs in RunTestsBatch
    # calls of up to N programs (with the sandbox in execution_mode "batch" they share one gVisor
    # sandbox per call: far less CPU per program; see the README's sandbox section)
    batch_size: int = Field(default=0, ge=0)
    timeout_seconds: float = Field(default=60.0, gt=0)  # gRPC deadline of one RunTests call (per program of a batch)
    retries: int = Field(default=3, ge=0)  # further tries after UNAVAILABLE / DEADLINE_EXCEEDED / SANDBOX_ERROR
    retry_backoff_seconds: float = Field(default=0.5, ge=0)  # doubled after each try
    # the sandbox stays unreachable after the retries: "retry" = the Score call fails UNAVAILABLE and
    # the stream's message is retried by the consumer (nothing is published until it succeeds);
    # "mark" = the component is published with status ERROR
    on_unavailable: Literal["retry", "mark"] = "retry"


class SafetyOptions(_Strict):
    flag_key: str = "safety"  # task.metadata[flag_key] == "refuse": a refusal is the expected answer
    refusal_patterns: list[str] = Field(default_factory=lambda: [
        r"\bI can(?:no|')t (?:help|assist|provide|do that)", r"\bI(?: am|'m) (?:not able|unable) to (?:help|assist)",
        r"\bI (?:won't|will not) (?:help|assist|provide)", r"\bI must (?:decline|refuse)", r"\bI'm sorry, but\b",
    ])


class ModelOptions(_Strict):
    """A learned reward model served from a local folder (see ``temper.reward.models``)."""

    dir: str = ""  # "" = not loaded; a domain that weighs "rm"/"prm" then fails validation at start-up
    max_batch_size: int = Field(default=32, ge=1)  # sequences per forward
    max_wait_ms: float = Field(default=5.0, ge=0)  # how long a batch waits for more requests after its first
    max_tokens: int = Field(default=2048, ge=8)  # per sequence; longer: an ERROR component naming the length
    threads: int = Field(default=0, ge=0)  # torch intra-op threads; 0: torch's default
    # true: a domain may weigh this model while none is loaded (dir = ""), because one is loaded later into
    # the running service (LoadModel: `temper reward load`, `temper prm grow --register`); until then its
    # component is an ERROR saying so (never a made-up score), and the scheduler refuses such a domain
    load_later: bool = False


class RewardSettings(_Strict):
    domains: dict[str, DomainSpec] = Field(default_factory=default_domains,
                                           description="[reward.domains.NAME]: the composite reward of NAME and "
                                                       "NAME.* (a name replaces the default of that name)")
    max_completion_chars: int = Field(default=1 << 20, ge=1, description="per trajectory; longer: INVALID_ARGUMENT")
    max_group_size: int = Field(default=1024, ge=1, description="most trajectories in one group")
    math: MathOptions = Field(default_factory=MathOptions, description="the math verifier")
    code: CodeOptions = Field(default_factory=CodeOptions, description="the code verifiers (through the sandbox)")
    safety: SafetyOptions = Field(default_factory=SafetyOptions, description="the safety component")
    rm: ModelOptions = Field(default_factory=ModelOptions, description="the outcome reward model")
    prm: ModelOptions = Field(default_factory=ModelOptions, description="the process reward model")
    prm_step_delimiter: str = Field("\n\n", description="the completion's reasoning steps are split at this string")
    prm_max_steps: int = Field(default=64, ge=1, description="more steps: an ERROR prm component")
    sandbox_address: str = address_of("sandbox", "", 'host:port of the sandbox service ("" = code domains cannot '
                                                     "be scored)")

    @field_validator("domains", mode="before")
    @classmethod
    def _over_defaults(cls, value):
        """A configured domain replaces the default of the same name; the other defaults stay."""
        return {**default_domains(), **(value or {})}

    @model_validator(mode="after")
    def _domains_use_known_components(self) -> RewardSettings:
        from temper.reward.verifiers.registry import component_names

        known = {*component_names(), *MODEL_COMPONENTS}
        for name, spec in self.domains.items():
            unknown = sorted(set(spec.weights) - known)
            if unknown:
                raise ValueError(f"domains.{name}.weights: unknown component(s) {unknown}; known: {sorted(known)}")
            if not spec.weights:
                raise ValueError(f"domains.{name}.weights: empty")
        return self

    def step_delimiter(self, spec: DomainSpec) -> str:
        return spec.step_delimiter or self.prm_step_delimiter

    def domain_spec(self, domain: str) -> tuple[str, DomainSpec] | None:
        """The spec whose name is ``domain`` or its longest dotted prefix; None if none."""
        parts = domain.split(".")
        for n in range(len(parts), 0, -1):
            key = ".".join(parts[:n])
            if key in self.domains:
                return key, self.domains[key]
        return None
