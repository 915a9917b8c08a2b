"""LoRA adapters (PEFT) on the actor and the critic.

With ``model.lora_rank > 0`` only the low-rank adapters (and, for the critic, its value head)
are trained; the base weights stay frozen, so the reference policy is the same module with its
adapters switched off (``with module.disable_adapter():``) and no second copy of the weights
exists. Checkpoints hold the trainable tensors only; the Hugging Face export and the vLLM weight
sync get the merged weights ``W + (alpha / r) * B @ A`` under the base model's own names
(:func:`merged_state_dict`), computed from a state dict so the module itself is never modified. The actor's
checkpoints and Hugging Face exports also hold its adapter as peft saves it (:func:`save_adapter`, verl's
``lora_adapter`` folder), which ``PeftModel.from_pretrained`` loads over the base model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER = "default"
PEFT_PREFIX = "base_model.model."
CRITIC_HEADS = ("score", "classifier")
ADAPTER_DIR = "lora_adapter"  # verl's folder of the actor's adapter, beside its checkpoint files


def _lora_config(model: torch.nn.Module, rank: int, alpha: int, target_modules: str | list[str], critic: bool):
    """peft's config for ``model``; for a critic the value head is excluded and trained in full (``modules_to_save``)."""
    from peft import LoraConfig, TaskType

    heads = [name for name in CRITIC_HEADS if hasattr(model, name)] if critic else []
    return LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none",
        exclude_modules=heads or None, modules_to_save=heads or None,
        task_type=TaskType.TOKEN_CLS if critic else TaskType.CAUSAL_LM,
    )


def _peft_model(model: torch.nn.Module, config) -> torch.nn.Module:
    """peft's ``get_peft_model``, without the FutureWarning transformers gives peft's own read of the model's
    deprecated ``is_gradient_checkpointing`` (a warning about peft's code, not the run's, at every LoRA start)."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def apply_lora(model: torch.nn.Module, rank: int, alpha: int, target_modules: str | list[str],
               critic: bool = False) -> torch.nn.Module:
    """``model`` wrapped with fresh LoRA adapters (B = 0: the wrapped model computes what it did before).

    For a critic the value head is excluded from the adapters and trained in full (``modules_to_save``).
    Adapters the rollout's and the export's weights cannot hold (:func:`refusals`) are refused.
    """
    linear = adaptable_linear_names(model)
    wrapped = _peft_model(model, _lora_config(model, rank, alpha, target_modules, critic))
    if problems := refusals(wrapped, linear):
        raise ValueError("; ".join(problems))
    wrapped.config.use_cache = True
    return wrapped


def refusals(wrapped: torch.nn.Module, linear: list[str]) -> list[str]:
    """Why the adapters of ``wrapped`` (a peft model) cannot be trained here, as sentences; empty where they can.
    ``linear``: the model's :func:`adaptable_linear_names`, for the advice.

    The rollout (vLLM's weight sync) and the Hugging Face export take the merged ``W + s B A`` of each adapted
    ``nn.Linear``: other layers do not merge so (:func:`_unmergeable`), and an output head whose weight is the
    input embedding's (``tie_word_embeddings``) is one tensor there, written and loaded as the embedding: the
    adapted head would be dropped and the base model's head scored and sampled instead.
    """
    model, problems = wrapped.get_base_model(), []
    if unmergeable := [f"{name.removeprefix(PEFT_PREFIX)} ({type(getattr(layer, 'base_layer', layer)).__name__})"
                       for name, layer in wrapped.named_modules() if _unmergeable(layer)]:
        problems.append(f"LoRA adapters on {', '.join(unmergeable[:4])}: only adapters of linear layers (torch.nn."
                        f"Linear) are merged into the rollout's and the export's weights; {advice(linear)}")
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "lora_A") and _tied(model):
        name = next(name for name, layer in model.named_modules() if layer is head)
        problems.append(f"LoRA adapters on {name}, the output head tied to the input embedding (tie_word_embeddings): "
                        "the rollout's and the export's weights hold one tensor for both, the embedding's, so the "
                        f"trained head would be lost there and the base model's used instead; leave {name} out: "
                        f"{advice(linear)}")
    return problems


def advice(linear: list[str]) -> str:
    """What model.target_modules may name, given a model's :func:`adaptable_linear_names`."""
    if not linear:
        return "the model has no linear layer LoRA can adapt here: train it in full, lora_rank=0"
    return f"set model.target_modules to some of its linear layers, [{','.join(linear)}], or all-linear"


def _tied(model: torch.nn.Module) -> bool:
    """Whether ``model``'s output head and input embedding share one weight (``tie_word_embeddings``)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return (head is not None and embedding is not None
            and getattr(head, "base_layer", head).weight is getattr(embedding, "base_layer", embedding).weight)


def adaptable_linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last parts of the names of ``model``'s ``nn.Linear`` layers that LoRA can adapt here (not an
    output head tied to the input embedding, nor a critic's value head), in the model's order. ``model``: a
    transformers model without adapters."""
    head = model.get_output_embeddings() if _tied(model) else None
    names: dict[str, None] = {}
    for name, layer in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(layer, torch.nn.Linear) and layer is not head and leaf not in CRITIC_HEADS:
            names[leaf] = None
    return list(names)


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


@dataclass
class TargetCheck:
    """What :func:`check_targets` found: the entries of target_modules that name no module, the sentences of
    :func:`refusals` for the modules they do name, and the model's adaptable linear layers (for the advice)."""

    unmatched: list[str]
    refusals: list[str]
    linear: list[str]


def check_targets(model_dir: str | Path, target_modules: str | list[str], trust_remote_code: bool = False,
                  override_config: dict | None = None, critic: bool = False, scorer: bool = False) -> TargetCheck:
    """LoRA's ``target_modules`` on the model in ``model_dir`` as :func:`apply_lora` would take them, before any
    weight is read: the model is built and wrapped on the meta device, in the form it trains in (a critic's
    token-classification form; with ``scorer``, a reward model's sequence-classification form, its head out of
    the adapters as a critic's). A model transformers cannot build in that form is left to the load to report
    (nothing found here).

    peft matches a list's entries against a module's name or its last parts, a string as a regular expression
    over whole names, and ``all-linear`` as every linear layer but the output head."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    critic = critic or scorer
    extra = {"num_labels": 1} if critic else {}
    config = AutoConfig.from_pretrained(str(Path(model_dir).expanduser()), trust_remote_code=trust_remote_code,
                                        **extra, **(override_config or {}))
    auto = AutoModelForSequenceClassification if scorer else AutoModelForTokenClassification if critic \
        else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError:  # e.g. no token-classification class for this architecture: the load says so itself
        return TargetCheck([], [], [])
    linear = adaptable_linear_names(model)
    unmatched = []
    if target_modules != "all-linear":
        names = [name for name, _ in model.named_modules() if name]
        targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        unmatched = [target for target in targets
                     if not any(check_target_module_exists(LoraConfig(target_modules=target if isinstance(
                         target_modules, str) else [target]), name) for name in names)]
        if len(unmatched) == len(targets):  # peft refuses a config that adapts nothing
            return TargetCheck(unmatched, [], linear)
    try:
        with torch.device("meta"):
            wrapped = _peft_model(model, _lora_config(model, 1, 1, target_modules, critic))
    except ValueError as exc:  # all-linear on a model without a linear layer
        return TargetCheck(unmatched, [f"{str(exc).splitlines()[0]}; {advice(linear)}"], linear)
    return TargetCheck(unmatched, refusals(wrapped, linear), linear)


def target_problems(key: str, model_dir: str | Path, target_modules: str | list[str], trust_remote_code: bool = False,
                    override_config: dict | None = None, critic: bool = False, scorer: bool = False) -> list[str]:
    """:func:`check_targets` said as sentences for the config section ``key`` (``actor_rollout_ref.model``, ...):
    the targets that name no module, with the list form to write or the model's linear layers, and the adapters
    the rollout's and the export's weights cannot hold. Empty where the targets can be trained."""
    found = check_targets(model_dir, target_modules, trust_remote_code, override_config, critic=critic, scorer=scorer)
    problems = []
    if isinstance(target_modules, str) and found.unmatched:  # peft reads a string as one regular expression
        problems.append(
            f"{key}.target_modules={target_modules}: a string is a regular expression over whole module names (such "
            f"as model.layers.0.self_attn.q_proj) and matches no module of {model_dir}; "
            + (f"for the layers named {target_modules}, write the list [{target_modules}]"
               if target_modules in found.linear else advice(found.linear)))
    elif found.unmatched:
        problems.append(f"{key}.target_modules: {', '.join(map(str, found.unmatched))} names no module of "
                        f"{model_dir} (an entry is a module's name or its last parts); {advice(found.linear)}")
    return problems + [f"{key}.target_modules ({model_dir}): {problem}" for problem in found.refusals]


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


def save_adapter(module: torch.nn.Module, state: dict[str, torch.Tensor], target: str | Path,
                 base_model_path: str | Path) -> None:
    """``module``'s adapter as peft's ``save_pretrained`` writes it (``adapter_model.safetensors``,
    ``adapter_config.json``, its ``README.md``), holding the tensors of ``state`` (whole, under the module's own
    names: gathered from FSDP shards where sharded) rather than the module's own, over the base model at
    ``base_model_path``: ``PeftModel.from_pretrained(that base, target)`` is the policy ``module`` computes.

    The embedding is never adapted here (:func:`refusals`), so none is saved: peft's ``"auto"`` would look the
    base model up (on the Hub, where its path is no local folder) to decide."""
    adapter = module.peft_config[ADAPTER]
    adapter.base_model_name_or_path = str(base_model_path)
    # the card (README.md) names the base by its config's _name_or_path, the path as the model was loaded (relative,
    # perhaps): the same path as adapter_config.json's while it is written
    config = base_model(module).config
    loaded_as = config._name_or_path
    config._name_or_path = str(base_model_path)
    # peft writes a set (all-linear's target_modules: every module's full name) as list(set), in the order of
    # Python's string hashing, which differs between processes (PYTHONHASHSEED): sorted, two runs write the same file
    as_sets = {key: value for key, value in vars(adapter).items() if isinstance(value, set)}
    for key, value in as_sets.items():
        setattr(adapter, key, sorted(value))
    try:
        module.save_pretrained(str(target), state_dict=state, save_embedding_layers=False)
    finally:
        config._name_or_path = loaded_as
        for key, value in as_sets.items():
            setattr(adapter, key, value)


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
