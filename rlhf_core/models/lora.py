"""LoRA adapters (PEFT) on the actor and the critic.

With ``model.lora_rank > 0`` only the low-rank adapters (and, for the critic, its value head)
are trained; the base weights stay frozen, so the reference policy is the same module with its
adapters switched off (``with module.disable_adapter():``) and no second copy of the weights
exists. Checkpoints hold the trainable tensors only; the Hugging Face export and the vLLM weight
sync get the merged weights ``W + (alpha / r) * B @ A`` under the base model's own names
(:func:`merged_state_dict`), computed from a state dict so the module itself is never modified.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

ADAPTER = "default"
PEFT_PREFIX = "base_model.model."
CRITIC_HEADS = ("score", "classifier")


def apply_lora(model: torch.nn.Module, rank: int, alpha: int, target_modules: str | list[str],
               critic: bool = False) -> torch.nn.Module:
    """``model`` wrapped with fresh LoRA adapters (B = 0: the wrapped model computes what it did before).

    For a critic the value head is excluded from the adapters and trained in full (``modules_to_save``).
    """
    from peft import LoraConfig, TaskType, get_peft_model

    heads = [name for name in CRITIC_HEADS if hasattr(model, name)] if critic else []
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none",
        exclude_modules=heads or None, modules_to_save=heads or None,
        task_type=TaskType.TOKEN_CLS if critic else TaskType.CAUSAL_LM,
    )
    wrapped = get_peft_model(model, config)
    if unmergeable := [f"{name} ({type(getattr(layer, 'base_layer', layer)).__name__})"
                       for name, layer in wrapped.named_modules() if _unmergeable(layer)]:
        raise ValueError(f"LoRA adapters on {', '.join(unmergeable[:4])}: only adapters of linear layers are "
                         "merged into the rollout's and the export's weights; set model.target_modules to the "
                         "model's linear projections (e.g. [q_proj,v_proj])")
    wrapped.config.use_cache = True
    return wrapped


def _unmergeable(layer: torch.nn.Module) -> bool:
    """An adapted layer whose merge is not ``W + s B A`` on an ``nn.Linear`` weight: GPT-2's Conv1D (its weight
    stored transposed, ``fan_in_fan_out``), an embedding (``lora_embedding_A/B``), a convolution."""
    if not hasattr(layer, "lora_A") or not hasattr(layer, "base_layer"):
        return False
    return (not isinstance(layer.base_layer, torch.nn.Linear) or getattr(layer, "fan_in_fan_out", False)
            or bool(getattr(layer, "lora_embedding_A", None)))


def is_lora(module: torch.nn.Module) -> bool:
    return hasattr(module, "disable_adapter") and hasattr(module, "peft_config")


def lora_scaling(module: torch.nn.Module) -> float:
    config = module.peft_config[ADAPTER]
    return config.lora_alpha / config.r


def unmatched_targets(model_dir: str | Path, target_modules: str | list[str], trust_remote_code: bool = False,
                      override_config: dict | None = None) -> list[str]:
    """The entries of ``target_modules`` that name no module of the model in ``model_dir`` as peft matches them
    (a list: a module name or its last parts; a string: a regular expression over whole names; ``all-linear``:
    every linear layer). The model is built on the meta device: no weights are read."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers import AutoConfig, AutoModelForCausalLM

    if target_modules == "all-linear":
        return []
    config = AutoConfig.from_pretrained(str(Path(model_dir).expanduser()), trust_remote_code=trust_remote_code,
                                        **(override_config or {}))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    names = [name for name, _ in model.named_modules() if name]
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    return [target for target in targets
            if not any(check_target_module_exists(LoraConfig(target_modules=target if isinstance(target_modules, str)
                                                             else [target]), name) for name in names)]


def trainable_names(module: torch.nn.Module) -> set[str]:
    return {name for name, param in module.named_parameters() if param.requires_grad}


def trainable_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA checkpoint holds: the adapters (and a critic's head), under the module's own names."""
    names = trainable_names(module)
    return {name: tensor for name, tensor in module.state_dict().items() if name in names}


def load_trainable_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    names = trainable_names(module)
    missing = sorted(names - set(state))
    unexpected = sorted(set(state) - set(module.state_dict()))
    if missing or unexpected:
        raise RuntimeError(f"LoRA state does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    module.load_state_dict(state, strict=False)


def merged_state_dict(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT LoRA state dict -> the base model's state dict with the adapters merged in.

    ``...q_proj.base_layer.weight`` + ``lora_A`` / ``lora_B`` -> ``...q_proj.weight = W + scaling * B @ A``;
    ``modules_to_save`` copies replace their originals; the ``base_model.model.`` prefix is removed.
    A state dict without adapters passes through unchanged.
    """
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".lora_" in name or ".original_module." in name:
            continue
        key = name.removeprefix(PEFT_PREFIX)
        if ".base_layer." in name:
            prefix, leaf = name.split(".base_layer.")
            key = f"{prefix.removeprefix(PEFT_PREFIX)}.{leaf}"
            lora_a = state.get(f"{prefix}.lora_A.{ADAPTER}.weight")
            lora_b = state.get(f"{prefix}.lora_B.{ADAPTER}.weight")
            if leaf == "weight" and lora_a is not None and lora_b is not None:
                delta = scaling * (lora_b.float() @ lora_a.float())  # (out, r) @ (r, in)
                tensor = (tensor.float() + delta).to(tensor.dtype)
        elif f".modules_to_save.{ADAPTER}." in name:
            key = key.replace(f".modules_to_save.{ADAPTER}.", ".")
        merged[key] = tensor
    return merged


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (the module itself otherwise)."""
    return module.get_base_model() if is_lora(module) else module


def _merge_group(name: str) -> str | None:
    """The layer prefix of a tensor that takes part in a LoRA merge (base weight, A, B), else None."""
    for marker in (".base_layer.weight", f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"):
        if name.endswith(marker):
            return name[: -len(marker)]
    return None


def merged_tensors(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`merged_state_dict` over a stream of (name, tensor): each merged weight is yielded as soon
    as its base weight and both adapter matrices have been seen, so at most a layer is held at once."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        prefix = _merge_group(name)
        if prefix is None:
            yield from merged_state_dict({name: tensor}, scaling).items()
            continue
        group = pending.setdefault(prefix, {})
        group[name] = tensor
        if len(group) == 3:
            yield from merged_state_dict(pending.pop(prefix), scaling).items()
    for group in pending.values():  # a base weight without adapters
        yield from merged_state_dict(group, scaling).items()
