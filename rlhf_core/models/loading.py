"""Loading the actor, critic, reference and tokenizer from local HF model directories.

Every load and save of a model in training, evaluation, the smoke test and the reward model imports this module
first, in the commands, the ZenML steps and Ray's worker processes alike: its import is where transformers' own
progress bars are made to write lines where the output is not a terminal
(:func:`rlhf_core.progress.route_transformers_bars`). Not the package's ``__init__``: ``python -m
rlhf_core.models.toy`` (or ``.gguf``) runs it before the module's own code, which imports transformers only once a
Ctrl-C can be taken; the GGUF import, which reads its file without this module, routes them itself.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
)

from rlhf_core.atomic import give_usual_modes
from rlhf_core.models import cpu_matmul, packed_attention
from rlhf_core.progress import bars_about, route_transformers_bars

route_transformers_bars()

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model directory that cannot be used, named by its config key and path."""


@functools.cache
def takes_logits_to_keep(model_class: type) -> bool:
    """Whether the class's forward accepts ``logits_to_keep`` (asked once per class, not per call)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


@functools.cache
def cache_argument(model_class: type) -> str:
    """The name of the class's forward's KV-cache argument (asked once per class): transformers renamed
    ``past_key_values`` to ``cache`` during 5.x."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def resolve(path: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(str(path)))


def check_model_dir(path: str | os.PathLike, key: str = "actor_rollout_ref.model.path",
                    need_weights: bool = True) -> Path:
    """Raise ModelError unless ``path`` is a complete local HF model directory."""
    folder = resolve(path)
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        raise ModelError(f"{key}: {folder} is a GGUF file and models load from local HF directories; import it "
                         f"into one with rlhf gguf --gguf {folder} --output DIR and give DIR")
    if not folder.is_dir():
        raise ModelError(f"{key}: {missing_model_dir(path)}")
    if not (folder / "config.json").is_file():
        gguf = sorted(folder.glob("*.gguf"))
        raise ModelError(f"{key}: {folder} has no config.json; it is not a HF model directory" + (
            f" (it holds the GGUF file {gguf[0].name}: import it into one with rlhf gguf --gguf {gguf[0]} --output "
            "DIR and give DIR)" if gguf else ""))
    try:
        json.loads((folder / "config.json").read_text())
    except (ValueError, OSError) as exc:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise ModelError(f"{key}: {folder / 'config.json'} cannot be read as JSON ({exc}); is the copy complete?") \
            from exc
    if need_weights and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ModelError(f"{key}: {folder} has no weights (looked for {', '.join(WEIGHT_FILES)}); "
                         "is the download or copy incomplete?")
    if need_weights and (problem := _incomplete_weights(folder)):
        raise ModelError(f"{key}: {problem}; is the download or copy incomplete?")
    return folder


def _incomplete_weights(folder: Path) -> str | None:
    """What is missing or cut short in the weights transformers would load from ``folder`` (the first of
    :data:`WEIGHT_FILES` there, as it picks them; ``folder`` holds one): shards its index names that are absent,
    or a safetensors file whose header does not cover the file; None where they look whole. Only headers are read
    (safe_open maps the file and checks the header's offsets against its size), so this costs milliseconds on
    every start, where an incomplete copy would otherwise fail minutes later inside the load, maybe in a Ray
    worker."""
    name = next(name for name in WEIGHT_FILES if (folder / name).is_file())
    if name.endswith(".index.json"):
        try:
            shards = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{folder / name} cannot be read as a weight index ({type(exc).__name__}: {exc})"
        if not shards:
            return f"{folder / name} names no weight files"
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            return (f"{folder} lacks {len(missing)} of the {len(shards)} weight files that {name} names "
                    f"(first missing: {missing[0]})")
    else:
        shards = [name]
    for shard in shards:
        if shard.endswith(".safetensors"):
            try:
                with safe_open(str(folder / shard), "pt"):
                    pass
            except (SafetensorError, OSError) as exc:
                return f"{folder / shard} is not a complete safetensors file ({exc})"
    return None


def looks_like_hub_id(path: str | os.PathLike) -> bool:
    """Whether ``path``, which is not there, reads as a Hugging Face hub id (``ORG/NAME``) rather than a local
    path: two plain names, the first of which is no local folder either."""
    text = str(path)
    match = re.fullmatch(r"([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)", text)
    return match is not None and not resolve(text).exists() and not Path(match[1]).is_dir()


def missing_model_dir(path: str | os.PathLike) -> str:
    """Why a model path that is no directory cannot load, and what to do: for a hub id, how to get a local copy
    (nothing is downloaded at run time); for any other path, how to build the demo model."""
    folder = resolve(path)
    if looks_like_hub_id(path):
        return (f"{folder} is not a directory: models load from local HF directories and nothing is downloaded "
                f"at run time. If {path} is a Hugging Face hub id, download it on a machine with access "
                f"(huggingface-cli download {path} --local-dir DIR), copy DIR here and give its path; a GGUF file "
                "of it imports with rlhf gguf --gguf FILE --output DIR")
    return (f"{folder} is not a directory (models load from local HF directories; build the demo model with "
            "python -m rlhf_core.models.toy --output DIR)")


#: the heads of transformers architectures that score or label text rather than generate it, and what a model
#: with one is: a folder whose every architecture ends so has no language-model head to generate with
NOT_GENERATIVE = {
    "ForSequenceClassification": "a reward/classification model (one score per sequence)",
    "ForRewardModel": "a reward model (one score per sequence, from its own head)",
    "ForProcessRewardModel": "a process reward model (scores for each step of a solution)",
    "ForTokenClassification": "a value/token-classification model (one score per token, as critics are saved)",
    "ForQuestionAnswering": "a question-answering (span extraction) model",
    "ForMultipleChoice": "a multiple-choice classification model",
    "ForMaskedLM": "a masked language model (it fills in blanks, it does not generate)",
}


def not_a_policy(folder: str | os.PathLike) -> str | None:
    """What ``folder`` (a HF model directory) holds where it cannot act as a policy: a reward or other
    classification model, by its config's ``architectures`` (all of them of :data:`NOT_GENERATIVE`); else None
    (a causal LM, an architecture this cannot tell, or a config without the field). Reads config.json only."""
    try:
        architectures = json.loads((resolve(folder) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):  # unreadable or no mapping: check_model_dir says so
        return None
    kinds = [next((kind for head, kind in NOT_GENERATIVE.items() if str(name).endswith(head)), None)
             for name in architectures]
    if not kinds or None in kinds:
        return None
    return (f"{resolve(folder)} holds {kinds[0]}: {', '.join(architectures)}, not a causal language model; a "
            "policy generates its responses through a language-model head, which this has not; give a causal LM "
            "(config architectures *ForCausalLM), e.g. the model the reward model was trained from, and use a "
            "reward model as reward_model.model.path (it may also start the critic, critic.model.path)")


def check_policy_dir(path: str | os.PathLike, key: str = "actor_rollout_ref.model.path",
                     need_weights: bool = True) -> Path:
    """:func:`check_model_dir` of a model that generates (the actor's): ModelError also where it holds a reward or
    other classification model (:func:`not_a_policy`)."""
    folder = check_model_dir(path, key, need_weights)
    problem = not_a_policy(folder)
    if problem is not None:
        raise ModelError(f"{key}: {problem}")
    return folder


def check_tokenizer_dir(path: str | os.PathLike, key: str) -> Path:
    folder = resolve(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not folder.is_dir() or not any((folder / n).is_file() for n in names):
        raise ModelError(f"{key}: {folder} holds no tokenizer files (looked for {', '.join(names)})")
    return folder


#: what to do where the driver (the command's own process) cannot import an external_lib
LOCAL_IMPORT_HINT = ("a module of the current folder imports where the folder is on PYTHONPATH (PYTHONPATH=. ...), "
                     "which the installed commands do not add")
#: ... and where a Ray worker cannot, which imports it again in its own process, maybe on another node
WORKER_IMPORT_HINT = ("each Ray worker imports it: it must be importable on every node of the cluster (installed "
                      "there, or in a folder on the PYTHONPATH that node's Ray was started with: the driver's "
                      "PYTHONPATH does not reach the workers of a cluster joined with trainer.ray_address), or be "
                      "shipped with trainer.ray_runtime_env (verl's ray_kwargs.ray_init.runtime_env), e.g. "
                      "+ray_kwargs.ray_init.runtime_env.py_modules=[/path/to/its/package]")


def import_external_lib(name: str | None, key: str = "actor_rollout_ref.model.external_lib",
                        hint: str = LOCAL_IMPORT_HINT) -> None:
    """Import the module ``name`` (verl's ``external_lib``: it registers custom architectures with transformers);
    raise ModelError naming ``key``, with ``hint`` (what to do), where it cannot be imported."""
    if name:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ModelError(f"{key}: module {name!r} cannot be imported ({exc}); {hint}") from exc


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(path)), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def max_positions(path: str | os.PathLike, trust_remote_code: bool = False,
                  override_config: dict | None = None) -> int | None:
    config = AutoConfig.from_pretrained(str(resolve(path)), trust_remote_code=trust_remote_code,
                                        **(override_config or {}))
    return getattr(config, "max_position_embeddings", None)


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Recompute ``model``'s activations in backward (non-reentrant), by the name this transformers has: the
    older ``gradient_checkpointing_enable`` warns that it is deprecated where the newer name exists."""
    if hasattr(model, "activation_checkpointing_enable"):  # the 5.x name
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _finish(model: PreTrainedModel, gradient_checkpointing: bool, device: torch.device) -> PreTrainedModel:
    if gradient_checkpointing:
        enable_checkpointing(model)
    model.config.use_cache = True
    # eval mode: the rollout-time passes (generation, log-probs, values) draw no dropout; the updates switch to
    # train mode, where a model's dropout runs unless its disable_dropout key turns it off
    model = model.to(device).eval()
    cpu_matmul.route(model)
    return model


#: the dropout modules whose rate is their ``p``
DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
                   torch.nn.FeatureAlphaDropout)


#: names of float attributes that draw noise in train mode though they do not say dropout: the jitter that
#: mixture-of-experts routers multiply their input by (Mixtral's router_jitter_noise and its blocks' copy,
#: jitter_noise; PhiMoE's input_jitter_noise; DBRX's moe_jitter_eps)
NOISE_NAMES = ("drop", "jitter_noise", "jitter_eps")
#: by model_type, attributes those names match that are not noise: PhiMoE's router_jitter_noise is the
#: threshold of its routers' expert mask (sparsemixer's jitter_eps), read in eval mode too
NOT_NOISE = {"phimoe": frozenset({"router_jitter_noise"})}


def _is_noise_rate(name: str, value, not_noise: frozenset[str] = frozenset()) -> bool:
    """A float attribute that sets train-mode noise: a dropout rate (``resid_pdrop``, ``hidden_dropout_prob``,
    ``attention_dropout``, ``layerdrop``, ``drop_path_rate`` ...) or a router's jitter (``router_jitter_noise``),
    a config's or the copy a module took of it when it was built; none named in ``not_noise``."""
    return type(value) is float and any(part in name.lower() for part in NOISE_NAMES) and name not in not_noise


def _configs(config: PreTrainedConfig, prefix: str = "") -> list[tuple[str, PreTrainedConfig]]:
    """``config`` and the configs nested in it (``text_config``, ...), each with its dotted path."""
    found = [(prefix, config)]
    for name, value in vars(config).items():
        if isinstance(value, PreTrainedConfig):
            found += _configs(value, f"{prefix}{name}.")
    return found


def _not_noise(config: PreTrainedConfig) -> frozenset[str]:
    """The attributes of :data:`NOT_NOISE` for the model types of ``config`` and the configs nested in it."""
    return frozenset().union(*(NOT_NOISE.get(getattr(nested, "model_type", None), ()) for _, nested in
                               _configs(config)))


def dropout_rates(config: PreTrainedConfig) -> dict[str, float]:
    """The train-mode noise rates (dropout, a router's jitter) of ``config`` and the configs nested in it, by
    dotted attribute path (``resid_pdrop``, ``text_config.attention_dropout``, ``router_jitter_noise``)."""
    not_noise = _not_noise(config)
    return {prefix + name: value for prefix, nested in _configs(config) for name, value in vars(nested).items()
            if _is_noise_rate(name, value, not_noise)}


def disable_dropout(model: torch.nn.Module) -> dict[str, float]:
    """Every dropout of ``model`` off, in train mode too, and every router jitter: each dropout module's ``p``,
    every float attribute of :func:`_is_noise_rate` on its modules (Llama's and Qwen's attentions pass their
    ``attention_dropout``, a copy of the config's, to sdpa; Mixtral's MoE blocks their ``jitter_noise``) and on
    its config and the configs nested in it (GPT-Neo's and Persimmon's attentions read
    ``config.attention_dropout`` in their forward). LoRA layers added afterwards keep their own. Returns the
    config's rates as they were, by dotted attribute path (``resid_pdrop``, ``text_config.attention_dropout``),
    for :func:`config_with` to give an export the base's settings back."""
    base = dropout_rates(model.config)
    not_noise = _not_noise(model.config)
    for _, config in _configs(model.config):
        _zero_noise_rates(config, not_noise)
    for module in model.modules():
        if isinstance(module, DROPOUT_MODULES):
            module.p = 0.0
        _zero_noise_rates(module, not_noise)
    return base


def _zero_noise_rates(holder, not_noise: frozenset[str]) -> None:
    """Every float attribute of ``holder`` (a config or a module) that :func:`_is_noise_rate` names, set to 0."""
    for name, value in list(vars(holder).items()):
        if _is_noise_rate(name, value, not_noise):
            setattr(holder, name, 0.0)


def train_mode_differs(model: torch.nn.Module, tokens: int = 32) -> bool | None:
    """Whether ``model``'s train-mode forward differs from its eval-mode one on ``tokens`` token ids: whether its
    updates draw noise its rollout-time passes do not. What the built model runs decides, not its config: a rate
    for a head the model lacks (GPT-NeoX's classifier_dropout in a causal LM) draws nothing, and a router that
    samples its experts in train mode (PhiMoE's) draws though no rate names it. None where the forward cannot
    run on bare token ids, or gives NaN or inf (weights that do: NaN never equals itself, which read as noise
    drawn, and the run then stops on those weights with its own message). The generators are left as they
    were, the model in the mode it was in."""
    training = model.training
    device = next(model.parameters()).device
    try:
        ids = torch.arange(1, tokens + 1, device=device).remainder(model.config.get_text_config().vocab_size)[None]
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            outputs = [model.train(mode)(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                                         output_hidden_states=True) for mode in (False, True)]
    except Exception:  # noqa: BLE001 - an architecture that wants other inputs: the caller reads the config instead
        return None
    finally:
        model.train(training)
    # the hidden states too: a new value head is zero, and its values are 0 in both modes whatever the backbone draws
    # (an output without them, from remote code that ignores output_hidden_states, has its logits compared alone)
    evaluated, trained = (_compared(output) for output in outputs)
    if not evaluated or len(evaluated) != len(trained) or not all(t.isfinite().all() for t in evaluated + trained):
        return None
    return not all(torch.equal(a, b) for a, b in zip(evaluated, trained))


def _compared(output) -> list[torch.Tensor]:
    """The tensors of a forward's ``output`` that :func:`train_mode_differs` compares: its hidden states and its
    logits, those it has."""
    hidden = getattr(output, "hidden_states", None) or ()
    logits = getattr(output, "logits", None)
    return [*hidden, *([logits] if logits is not None else [])]


def config_with(config: PreTrainedConfig, values: dict[str, float]) -> PreTrainedConfig:
    """A copy of ``config`` with ``values`` (dotted attribute paths, as :func:`disable_dropout` returns them) set."""
    config = copy.deepcopy(config)
    for path, value in values.items():
        *parents, name = path.split(".")
        target = functools.reduce(getattr, parents, config)
        setattr(target, name, value)
    return config


def attention_for(use_remove_padding: bool, device: torch.device | str) -> str | None:
    """The attention for packed sequences where they are asked for: ``flash_attention_2`` on CUDA with flash-attn,
    :data:`packed_attention.NAME` on the CPU and on CUDA without it; None (the model's default attention)
    otherwise."""
    if not use_remove_padding:
        return None
    kind = torch.device(device).type
    if kind == "cuda" and importlib.util.find_spec("flash_attn"):
        return "flash_attention_2"
    return packed_attention.NAME if kind in ("cpu", "cuda") else None


def _attn_kwargs(attn_implementation: str | None) -> dict:
    return {"attn_implementation": attn_implementation} if attn_implementation else {}


def load_actor(path: str | os.PathLike, dtype: str = "float32", gradient_checkpointing: bool = False,
               trust_remote_code: bool = False, device: torch.device | str = "cpu",
               attn_implementation: str | None = None, override_config: dict | None = None,
               about: str | None = None) -> PreTrainedModel:
    """The causal LM at ``path``; ``override_config`` sets attributes of its config before the weights load
    (verl's ``model.override_config``, e.g. ``attention_dropout``). The load's progress lines name ``about`` (what
    the model is, e.g. ``trained policy: <path>``), else ``path``."""
    config = AutoConfig.from_pretrained(str(resolve(path)), trust_remote_code=trust_remote_code,
                                        **(override_config or {}))
    with bars_about(about or str(path)):
        model = AutoModelForCausalLM.from_pretrained(
            str(resolve(path)), config=config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
            **_attn_kwargs(attn_implementation))
    return _finish(model, gradient_checkpointing, torch.device(device))


def load_critic(path: str | os.PathLike, dtype: str = "float32", gradient_checkpointing: bool = False,
                trust_remote_code: bool = False, device: torch.device | str = "cpu",
                seed: int = 0, attn_implementation: str | None = None,
                override_config: dict | None = None) -> PreTrainedModel:
    """A token-level value model (one label) on the backbone at ``path``. A head the checkpoint holds (a
    reward model's, or a critic's) is kept, as verl keeps it; a new one starts at zero. ``override_config``
    as for :func:`load_actor`."""
    quiet = [logging.getLogger("transformers.modeling_utils"),  # "newly initialised score weights" is expected
             logging.getLogger("transformers.distributed.tensor_parallel")]  # and so is "score was not sharded"
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        torch.manual_seed(seed)
        config = AutoConfig.from_pretrained(str(resolve(path)), num_labels=1, trust_remote_code=trust_remote_code,
                                            **(override_config or {}))
        config.classifier_dropout = 0.0  # values must not differ between the rollout-time pass and the update
        with bars_about(f"{path}, as a value model"):
            model, loading = AutoModelForTokenClassification.from_pretrained(
                str(resolve(path)), config=config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
                output_loading_info=True, **_attn_kwargs(attn_implementation))
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    name = "score" if hasattr(model, "score") else "classifier"
    head = getattr(model, name, None)
    if head is not None and f"{name}.weight" in loading["missing_keys"]:
        with torch.no_grad():
            head.weight.zero_()  # values start at 0: early advantages are the rewards themselves
            if getattr(head, "bias", None) is not None:
                head.bias.zero_()
    return _finish(model, gradient_checkpointing, torch.device(device))


#: the blocks ``use_torch_compile`` compiles: elementwise work between matmuls, no KV cache inside
COMPILED_BLOCKS = ("MLP", "RMSNorm")


def compile_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``torch.compile`` (inductor, dynamic shapes) each MLP and RMS norm of ``model`` in place, so that
    their activations, products and normalisations run as fused kernels in every pass, the rollout's
    included. Attention stays eager: its KV cache is Python state that changes every decode step.
    Blocks of one class share their compiled code. Returns the compiled blocks."""
    blocks = [module for module in model.modules() if type(module).__name__.endswith(COMPILED_BLOCKS)]
    for block in blocks:
        block.compile(dynamic=True)
    return blocks


def make_reference(actor: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy of the initial actor."""
    reference = copy.deepcopy(actor).eval()
    for param in reference.parameters():
        param.requires_grad_(False)
    return reference


def hf_class(model: torch.nn.Module) -> type[PreTrainedModel]:
    """The transformers class of ``model``, looking through the class FSDP2 wraps it in."""
    from torch.distributed.fsdp import FSDPModule

    for cls in type(model).__mro__:
        if issubclass(cls, PreTrainedModel) and not issubclass(cls, FSDPModule):
            return cls
    raise TypeError(f"{type(model).__name__} is not a transformers model")


def save_hf_model(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], target: str | os.PathLike,
                  config: PreTrainedConfig | None = None) -> None:
    """``save_pretrained`` of ``model``'s architecture holding ``state_dict`` (full tensors under the
    transformers names, e.g. gathered from FSDP shards or with LoRA merged in), under ``config`` (default: the
    model's own). The model is rebuilt on the meta device, so nothing is allocated besides ``state_dict`` itself."""
    with torch.device("meta"):
        clean = hf_class(model)(copy.deepcopy(model.config if config is None else config))
    clean.load_state_dict(state_dict, strict=True, assign=True)
    clean.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        clean.generation_config = copy.deepcopy(model.generation_config)
    clean.save_pretrained(target)
    give_usual_modes(target)  # safetensors writes its file private to the owner, the rest as open() would


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _first_difference(vocab: dict[str, int], other: dict[str, int]) -> str:
    by_id, other_by_id = {i: t for t, i in vocab.items()}, {i: t for t, i in other.items()}
    for index in sorted(set(by_id) | set(other_by_id)):
        if by_id.get(index) != other_by_id.get(index):
            return f"id {index} is {by_id.get(index)!r} vs {other_by_id.get(index)!r}"
    return "the same ids"


def tokenizer_problems(actor_tokenizer: tuple[str, str | os.PathLike], tokenizers: list[tuple[str, str | os.PathLike]],
                       models: list[tuple[str, str | os.PathLike]], trust_remote_code: bool = False,
                       renders_prompts: tuple[str, ...] = ()) -> list[str]:
    """What stops the tokenizers from working together, read from their files (no weights load).

    ``actor_tokenizer`` is (config key, directory) of the tokenizer that encodes prompts and decodes
    responses: it needs a chat template (the prompts are chat messages). Every other tokenizer in
    ``tokenizers`` (key, directory) must have the same vocabulary, those whose keys ``renders_prompts`` names
    (the data checks measure prompts with them) the same chat template too, and every model in ``models``
    (key, directory) an embedding large enough for its ids.
    """
    key, path = actor_tokenizer
    tokenizer = load_tokenizer(path, trust_remote_code)
    problems = []
    if not getattr(tokenizer, "chat_template", None):
        problems.append(
            f"{key}: the tokenizer in {resolve(path)} has no chat template, so chat-message prompts cannot be "
            "rendered as the model was trained to read them; use the instruct checkpoint's tokenizer (a "
            "chat_template in tokenizer_config.json or a chat_template.jinja file)")
    vocab = tokenizer.get_vocab()
    for other_key, other_path in tokenizers:
        folder = resolve(other_path)
        if folder == resolve(path):
            continue
        if not _has_tokenizer_files(folder):  # a model directory may leave its tokenizer to the actor's
            if not other_key.endswith("model.path"):
                problems.append(f"{other_key}: {folder} holds no tokenizer files (tokenizer.json, "
                                "tokenizer_config.json or tokenizer.model)")
            continue
        other_tokenizer = load_tokenizer(folder, trust_remote_code)
        other = other_tokenizer.get_vocab()
        if other != vocab:
            problems.append(
                f"{other_key} and {key} have different vocabularies ({len(other)} vs {len(vocab)} tokens; "
                f"{_first_difference(other, vocab)}): every model reads the actor's token ids, so use one "
                f"tokenizer family (point {other_key} at {resolve(path)}, or a model of the actor's family)")
        elif other_key in renders_prompts and \
                getattr(other_tokenizer, "chat_template", None) != getattr(tokenizer, "chat_template", None):
            problems.append(f"{other_key}: {other_path} has another chat template than {key} ({resolve(path)}), "
                            "with which training renders the prompts: the data checks would measure other prompts "
                            f"than the trainer reads; leave {other_key} null")
    for model_key, model_path in models:
        config = AutoConfig.from_pretrained(str(resolve(model_path)), trust_remote_code=trust_remote_code)
        size = getattr(config.get_text_config(), "vocab_size", None)
        if size is not None and size < len(tokenizer):
            problems.append(
                f"{model_key}: {resolve(model_path)} has vocab_size {size} but the tokenizer of {key} has "
                f"{len(tokenizer)} tokens; its embedding cannot read them: use a model of the tokenizer's family")
    return problems
