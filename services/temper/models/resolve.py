"""The model of a job, from its ``[model]`` table: any Hugging Face causal-LM folder, or the tiny recipe.

    [model]
    dir = ".temper/models/smollm2-135m-instruct"   # any HF causal-LM folder (safetensors, tokenizer)

    [model]
    preset = "tiny"                                # the built-in tiny recipe, built on first use
    dir = ".temper/models/tiny"                    # optional; default <home>/models/tiny
    hidden_size = 64                               # the recipe's knobs (tiny only)
    layers = 2
    heads = 2
    seed = 0

The resolved folder goes to inference and learner alike (the launcher passes it to both), so both
load the same weights; the learner trains on the token ids inference produced, so tokenization
(chat template, special tokens, EOS) is the inference tokenizer's on both sides. Everything is
checked before any service starts, each error naming its field: the folder exists, its
config.json is a causal LM, its tokenizer loads and fits the model's vocabulary and has an EOS
token. Only the tiny recipe ever writes a folder, and never one that holds something else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from temper.runtime.config import section_env_name
from temper.runtime.errors import InvalidArgument, require

PRESETS = ("tiny",)
TINY_KNOBS = ("hidden_size", "layers", "heads", "seed", "context")
TINY_MARKER = "temper-tiny-recipe.json"


@dataclass(frozen=True)
class ModelInfo:
    dir: Path
    preset: str  # "" for a folder used as it is
    architecture: str
    model_vocab_size: int
    tokenizer_vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    context_length: int


def resolve_model(table: dict | None, home: str | Path = ".temper", base: str | Path | None = None,
                  build: bool = True) -> ModelInfo:
    """Check the ``[model]`` table and return the folder it names (building the tiny recipe if asked).

    Relative dirs are taken from ``base`` (default: the working directory). ``build=False`` checks
    the table without building anything (a tiny folder not built yet is then only named).
    """
    table = dict(table or {})
    allowed = {"dir", "preset", *TINY_KNOBS}
    for key in sorted(table):
        require(key in allowed, f"model.{key}", f"unknown field; known: {sorted(allowed)}")
    preset = table.pop("preset", "")
    require(isinstance(preset, str) and (preset == "" or preset in PRESETS), "model.preset",
            f"unknown preset {preset!r}; known: {list(PRESETS)} (or leave it out and set dir to a model folder)")
    raw_dir = table.pop("dir", None)
    require(raw_dir is None or (isinstance(raw_dir, str) and raw_dir != ""), "model.dir", "must be a non-empty path")
    if preset == "tiny":
        model_dir = _absolute(raw_dir, base) if raw_dir else Path(home).resolve() / "models" / "tiny"
        for key, value in table.items():
            require(isinstance(value, int) and not isinstance(value, bool) and value >= (0 if key == "seed" else 1),
                    f"model.{key}", f"must be an integer >= {0 if key == 'seed' else 1}, got {value!r}")
        if "hidden_size" in table or "heads" in table:
            hidden, heads = table.get("hidden_size", 64), table.get("heads", 2)
            require(hidden % heads == 0, "model.heads", f"hidden_size {hidden} is not a multiple of heads {heads}")
        _refuse_foreign_folder(model_dir)
        if not build:
            return ModelInfo(model_dir, "tiny", "LlamaForCausalLM", 0, 0, (), False, 0)
        from temper.models.tiny import ensure_tiny_model

        ensure_tiny_model(model_dir, **table)
        return check_model_dir(model_dir, preset="tiny")
    knobs = sorted(table)
    require(not knobs, f"model.{knobs[0]}" if knobs else "model",
            "is a knob of the tiny recipe; it needs preset = \"tiny\" (a model folder is used as it is)")
    require(raw_dir is not None, "model.dir",
            "required: a Hugging Face causal-LM folder (or preset = \"tiny\" for the built-in tiny model)")
    return check_model_dir(_absolute(raw_dir, base))


def _absolute(path: str, base: str | Path | None) -> Path:
    p = Path(os.path.expanduser(path))
    return p if p.is_absolute() else Path(base or Path.cwd()).resolve() / p


def _refuse_foreign_folder(model_dir: Path) -> None:
    """The tiny recipe (re)builds only an empty or missing folder, or one it built itself."""
    if model_dir.is_dir() and any(model_dir.iterdir()) and not (model_dir / TINY_MARKER).exists():
        raise InvalidArgument(f"{model_dir} holds files the tiny recipe did not write; refusing to overwrite it "
                              f"(point dir at an empty folder, or drop preset to use it as a model)",
                              field="model.dir")


def check_model_dir(model_dir: str | Path, preset: str = "", field: str = "model.dir") -> ModelInfo:
    """ModelInfo of a causal-LM folder; InvalidArgument naming ``field`` if it is not one."""
    model_dir = Path(model_dir)
    require(model_dir.is_dir(), field, f"{model_dir} is not a folder")
    require((model_dir / "config.json").is_file(), field, f"{model_dir} has no config.json (not a Hugging Face model)")
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise InvalidArgument(f"config.json of {model_dir} does not load: {e}", field=field) from None
    architectures = list(getattr(config, "architectures", None) or [])
    causal = [a for a in architectures if a.endswith("ForCausalLM")]
    require(bool(causal) or (not architectures and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), field,
            f"{model_dir} is not a causal LM (architectures {architectures}, model_type {config.model_type!r})")
    weights = [p for p in model_dir.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json")]
    require(bool(weights), field, f"{model_dir} holds no safetensors weights")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f"the tokenizer of {model_dir} does not load: {e}", field=field) from None
    model_vocab = int(getattr(config, "vocab_size", 0) or 0)
    require(model_vocab > 0, field, f"config.json of {model_dir} has no vocab_size")
    require(len(tokenizer) <= model_vocab, field,
            f"tokenizer/vocab mismatch: the tokenizer has {len(tokenizer)} tokens, the model's embedding only "
            f"{model_vocab}")
    eos = getattr(config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    eos_ids = tuple(sorted(eos if isinstance(eos, list) else [eos])) if eos is not None else ()
    require(bool(eos_ids), field, f"{model_dir} names no EOS token (config.json eos_token_id or the tokenizer's)")
    require(all(0 <= e < model_vocab for e in eos_ids), field, f"EOS token ids {eos_ids} outside the vocabulary")
    return ModelInfo(dir=model_dir, preset=preset, architecture=(causal or [config.model_type])[0],
                     model_vocab_size=model_vocab, tokenizer_vocab_size=len(tokenizer), eos_token_ids=eos_ids,
                     has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
                     context_length=int(getattr(config, "max_position_embeddings", 0) or 0))


def check_service_tables(cfg: dict, model_dir: Path, base: str | Path | None = None) -> None:
    """A ``model_dir`` in [inference] or [learner] that differs from [model]: refused (both sides must
    load the same folder; the launcher passes [model]'s to both). A job with per-domain-group adapters
    ([job.adapters]) whose learner trains no LoRA, or whose server's max_lora_rank is below the learner's rank:
    refused, the field named."""
    for section in ("inference", "learner"):
        own = cfg.get(section, {}).get("model_dir")
        if own is not None:
            require(_absolute(str(own), base).resolve() == Path(model_dir).resolve(), f"{section}.model_dir",
                    f"{own!r} differs from [model] ({model_dir}); inference and learner load the [model] folder — "
                    f"set it there only")
    adapters = cfg.get("job", {}).get("adapters")
    if adapters:  # per-domain-group LoRA adapters: the learner trains them, inference serves them
        rank, where = _setting(cfg, "learner", "lora_rank", 0)
        require(isinstance(rank, int) and rank > 0, "learner.lora_rank",
                f"[job.adapters] trains LoRA adapters: set [learner] lora_rank > 0 (got {rank!r} from {where})")
        served, served_where = _setting(cfg, "inference", "max_lora_rank", 16)
        require(isinstance(served, int) and rank <= served, "inference.max_lora_rank",
                f"{served!r} ({served_where}) is below the learner's lora_rank {rank} ({where}): the server could not "
                f"load the adapters")


def _setting(cfg: dict, section: str, field: str, default):
    """(value, where from) of a service's setting as the service will start with it: its environment variable
    ``TEMPER_<SECTION>_<FIELD>`` (the launcher passes its environment to every service, and a service's config
    ranks it above the file: temper.runtime.config), else the job file's ``[section]`` table, else ``default``.
    An integer's text is read as the int; anything else is returned as given, for the caller's check."""
    name = section_env_name(section, field)
    raw = os.environ.get(name)
    if raw is not None:
        try:
            return int(raw), f"env {name}"
        except ValueError:
            return raw, f"env {name}"
    table = cfg.get(section, {})
    return (table[field], f"[{section}] {field}") if field in table else (default, "the default")
