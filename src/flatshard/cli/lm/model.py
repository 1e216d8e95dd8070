"""The language models ``flatshard train`` can train: its own GPT or a Hugging Face one.

Both are built the same way on every rank (same seed), see byte ids (vocab 256) and are
asked for logits the same way; the unit policy is the transformer block class.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import flatshard
from flatshard.cli.config import ConfigError
from flatshard.cli.internals import shard_keeping_last
from flatshard.cli.lm.config import GATHER_DTYPES, PRECISIONS, TrainConfig, unit_policy
from flatshard.cli.lm.data import VOCAB
from flatshard.cli.lm.lora import (
    adapter_init,
    add_adapters,
    checkpoint_name,
    merge_adapters,
    parse_lora,
)
from flatshard.cli.lm.optimizers import placement_for, with_experts
from flatshard.models import GPT, GPTBlock


@dataclass
class LanguageModel:
    """A model, the module classes that become units, and how to get logits from it."""

    module: nn.Module
    unit_classes: set[type[nn.Module]]
    description: str
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (B, T) ids -> (B, T, V)
    # --init pretrained: the module is on meta; fully_shard it with ``param_init_fn``, then
    # load the safetensors in ``weights``.
    weights: str | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    lora: bool = False  # peft adapters: loaded and exported under the base model's names


def build_language_model(config: TrainConfig) -> LanguageModel:
    torch.manual_seed(config.seed)
    lm = _hugging_face(config) if config.model.startswith("hf:") else _gpt(config)
    freeze(lm.module, config.freeze)
    return lm


def freeze(model: nn.Module, patterns: str) -> None:
    """``requires_grad=False`` for parameters whose names match a pattern (fnmatch)."""
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    names = [name for name, _ in model.named_parameters()]
    for pattern in wanted:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(f"--freeze: {pattern!r} matches no parameter (e.g. {names[0]!r})")
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in wanted):
            param.requires_grad_(False)
    if wanted and not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"--freeze {patterns!r} freezes every parameter: nothing to train")


def _gpt(config: TrainConfig) -> LanguageModel:
    """flatshard's GPT with GPT-2's initialization (small weights, zero biases)."""
    tied = config.pp == 1  # torch's pipelining cannot share a parameter between stages
    model = GPT(
        VOCAB,
        config.dim,
        config.heads,
        config.layers,
        config.seq_len,
        tied=tied,
        experts=config.experts,
    )
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    model.checkpoint_blocks = config.checkpoint_activations
    mlp = f", MLPs of {config.experts} experts" if config.experts else ""
    head = "" if tied else ", head untied"
    description = (
        f"GPT ({config.layers} blocks, width {config.dim}, {config.heads} heads{mlp}{head})"
    )
    return LanguageModel(model, {GPTBlock}, description, _call_model)


def _call_model(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(idx)
    return out


def _call_hf_model(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    # Training and the sample (which recomputes its context) keep no key-value cache;
    # transformers would build one in every forward where the config asks for it.
    out: torch.Tensor = model(input_ids=idx, use_cache=False).logits
    return out


def check_hugging_face(config: TrainConfig) -> None:
    """Fail early (one line) on a missing transformers, or a config it cannot build or
    cannot build a model of (``n_embd`` not a multiple of ``n_head``: on meta, nothing
    allocated)."""
    transformers = transformers_module()
    model_config = hf_config(transformers, config)
    cannot_build: tuple[type[Exception], ...] = (ValueError, TypeError, *_config_errors())
    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(model_config)
    except cannot_build as error:
        raise ConfigError(f"--model {config.model}: {_first_line(error)}") from None


def _config_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's validation errors of a config's fields (not ValueErrors)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def _first_line(error: Exception) -> str:
    """An error's first line, for a one-line message (at most 300 characters: transformers
    lists every model type it knows)."""
    lines = [line.strip() for line in str(error).strip().splitlines()] or [type(error).__name__]
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:  # "Validation error for field 'n_embd':"
        first = f"{first} {lines[1]}"
    return first if len(first) <= 300 else first[:300] + " ..."


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "--model hf:... needs the transformers package: pip install transformers"
        ) from None
    return transformers


def _hugging_face(config: TrainConfig) -> LanguageModel:
    transformers = transformers_module()
    model_config = hf_config(transformers, config)
    pretrained = config.init == "pretrained"
    with torch.device("meta") if pretrained else contextlib.nullcontext():
        model = cast(nn.Module, transformers.AutoModelForCausalLM.from_config(model_config))
    if config.checkpoint_activations:
        checkpoint_hf_blocks(model)
    block = block_class(model)
    description = f"{type(model).__name__} from {config.model[3:]} (units: {block.__name__})"
    if config.lora:
        model = add_adapters(model, parse_lora(config.lora))
        description += f", LoRA {config.lora}"
    lm = LanguageModel(model, {block}, description, _call_hf_model, lora=bool(config.lora))
    if pretrained:
        # skip_init rebuilds rotary embeddings (buffers in no checkpoint) from their config.
        lm.weights, lm.param_init_fn = config.model[3:], flatshard.skip_init
        if lm.lora:
            lm.param_init_fn = adapter_init(model, lm.param_init_fn)
        lm.description += ", pretrained weights"
    return lm


def checkpoint_hf_blocks(model: Any) -> bool:
    """Turn a transformers model's activation checkpointing on (non-reentrant, hooks
    included); False if it has none. transformers 5 renamed gradient_checkpointing_enable
    (now a deprecated alias that warns) to activation_checkpointing_enable. The config's
    ``use_cache`` stays as it is: it travels with an exported model, where generation
    reads it; the training calls pass ``use_cache=False`` instead."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        return False
    return True


def shard_language_model(
    lm: LanguageModel, config: TrainConfig, device: torch.device, process_group: Any = None
) -> nn.Module:
    """``fully_shard`` with the run's options (over ``process_group``: the world, or a
    pipeline stage's ranks); --init pretrained: then the sharded load."""
    low = PRECISIONS[config.mixed_precision]
    options: dict[str, Any] = {"strategy": config.sharding_strategy}
    if process_group is not None:
        options["process_group"] = process_group
    if config.sharding_factor:
        options["sharding_factor"] = config.sharding_factor
    gather = GATHER_DTYPES[config.gather_dtype]
    if low is not None or gather is not None:
        options["mixed_precision"] = flatshard.MixedPrecision(
            low, reduce_dtype=None if low is None else torch.float32, gather_dtype=gather
        )
    if config.cpu_offload:
        options["cpu_offload"] = flatshard.CPUOffload()
    options["placement"] = placement_for(
        config.optimizer, lm.module, lm.unit_classes, config.row_sparse_tables
    )
    if config.ep > 1:
        options["placement"] = with_experts(options["placement"], lm.module, config.ep)
    options["auto_wrap_policy"] = unit_policy(lm.unit_classes, config.units)
    if lm.weights is None:
        return shard_keeping_last(lm.module.to(device), config.keep_gathered, **options)
    options.update(param_init_fn=lm.param_init_fn, device=device)
    # On meta: each unit is allocated on ``device`` and filled by the load.
    model = shard_keeping_last(lm.module, config.keep_gathered, **options)
    load_weights(model, lm)
    return model


def load_weights(model: nn.Module, lm: LanguageModel) -> None:
    """--init pretrained: each rank reads its rows (the adapters are not in the files)."""
    if lm.weights is not None:
        names = checkpoint_name if lm.lora else None
        flatshard.load_safetensors(model, lm.weights, names=names)


def export_hugging_face(model: nn.Module, lm: LanguageModel, out_dir: Path) -> None:
    """The weights and config for ``from_pretrained`` (adapters merged into the base)."""
    names = None
    if lm.lora:
        merge_adapters(model, lm.unit_classes)
        names = checkpoint_name
    flatshard.export_safetensors(model, out_dir, names=names)


def hf_config(transformers: Any, config: TrainConfig, fit_to_bytes: bool = True) -> Any:
    """The named config (a directory, a config.json or a model type), fitted to bytes
    (the vocabulary, and positions for --seq-len) unless told not to."""
    spec = config.model[3:]
    overrides = parse_overrides(config.hf_overrides)
    cannot_load: tuple[type[Exception], ...] = (OSError, ValueError, *_config_errors())
    local = Path(spec).expanduser()
    path_like = spec.startswith((".", "/", "~")) or spec.endswith(".json")
    if path_like and not local.exists():
        what = "file" if spec.endswith(".json") else "directory"
        raise ConfigError(f"--model {config.model}: no such {what}: {local.absolute()}")
    try:
        if Path(spec).exists() or spec.endswith(".json") or "/" in spec:
            make = transformers.AutoConfig.from_pretrained
        else:
            make = transformers.AutoConfig.for_model
        loaded = make(spec, **overrides)  # (derived settings follow: head_dim, ...)
        _check_override_names(make(spec), loaded, overrides)
    except cannot_load as error:
        raise ConfigError(f"--model {config.model}: {_first_line(error)}") from None
    if not fit_to_bytes:
        return _fit_positions(loaded, config.seq_len)
    if config.init == "pretrained":  # the checkpoint's vocabulary; byte ids are some of it
        if loaded.vocab_size < VOCAB:
            raise ConfigError(
                f"--init pretrained: the vocabulary ({loaded.vocab_size}) has fewer "
                f"than {VOCAB} ids: the byte data would not fit"
            )
        return loaded
    loaded.vocab_size = VOCAB
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(loaded, name, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(loaded, name, None)
    return _fit_positions(loaded, config.seq_len)


def _check_override_names(default: Any, built: Any, overrides: dict[str, Any]) -> None:
    """A ConfigError for an --hf-overrides key the config does not know: transformers keeps
    any key as an attribute of its own, so a misspelled one (``n_layerz``) left the real
    setting at its default, a model of another size, without a word. A key the config
    consumed (``attn_implementation``, ``rope_theta`` into its rope parameters) or holds
    is known."""
    parameters = set(inspect.signature(type(default).__init__).parameters) - {"self", "kwargs"}
    for key in overrides:
        kept_alone = key in vars(built) and key not in vars(default)
        if kept_alone and key not in parameters and not hasattr(type(default), key):
            known = sorted({n for n in vars(default) if not n.startswith("_")} | parameters)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"--hf-overrides: {type(default).__name__} has no setting {key!r}{hint}"
            )


def _fit_positions(loaded: Any, seq_len: int) -> Any:
    for name in ("n_positions", "max_position_embeddings"):
        if getattr(loaded, name, seq_len) < seq_len:
            setattr(loaded, name, seq_len)
    return loaded


def parse_overrides(text: str) -> dict[str, Any]:
    """'n_layer=2,n_embd=64,tie_word_embeddings=false' -> typed values."""
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--hf-overrides: expected key=value, got {item!r}")
        values[key.strip()] = _typed(raw.strip())
    return values


def _typed(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def block_class(model: nn.Module) -> type[nn.Module]:
    """The class of the transformer blocks: the elements of the largest ``ModuleList``."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ConfigError(
            f"--model: {type(model).__name__} has no nn.ModuleList of blocks to shard by"
        )
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return type(largest[0])
