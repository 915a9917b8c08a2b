"""Reward functions, looked up by a sample's ``data_source``.

Every reward function has the signature::

    fn(data_source, solution_str, ground_truth, extra_info) -> float | dict

and is called with keyword arguments of exactly those names (as verl does). A dict result must
carry the reward under ``"score"``; ``"acc"`` says whether the response is right (else ``score >=
full_score``), ``"pred"`` the answer it gives (what ``maj@n`` votes on), and any other numeric entry
is reported as a metric (``critic/<key>/mean`` in training, ``val-aux/<source>/<key>/mean@n`` in
validation), as :class:`rlhf_core.rewards.manager.RewardManager` returns them.

Built-in sources are listed in :data:`REWARD_FNS`; anything else needs a user function loaded with
:func:`load_custom_reward_fn` (configured as ``custom_reward_function.path`` and
``custom_reward_function.name``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import itertools
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_core.rewards import gsm8k

if TYPE_CHECKING:
    from rlhf_core.config import PPOConfig

RewardFn = Callable[..., "float | dict[str, Any]"]


class UnknownDataSourceError(KeyError, ValueError):
    """No built-in reward function for a data source (catchable as KeyError or ValueError)."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0]) if self.args else ""


def gsm8k_reward(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict[str, Any]:
    """GSM8K rule: score 1.0 when the answer after the last ``#### `` equals the ground truth, else 0.0;
    ``acc`` the same as 0/1, and ``pred`` the answer graded (None when there is none), which the
    majority vote of ``maj@n`` counts."""
    score = gsm8k.compute_score(solution_str, ground_truth, method="strict")
    return {"score": score, "acc": score, "pred": gsm8k.extract_solution(solution_str, method="strict")}


REWARD_FNS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k_reward,
    "synthetic/arithmetic": gsm8k_reward,
}


def known_data_sources() -> list[str]:
    """The data sources with a built-in reward function, sorted."""
    return sorted(REWARD_FNS)


def get_reward_fn(data_source: str) -> RewardFn:
    """The built-in reward function for ``data_source``.

    Raises :class:`UnknownDataSourceError` naming the source and the known ones.
    """
    try:
        return REWARD_FNS[data_source]
    except (KeyError, TypeError):
        raise UnknownDataSourceError(
            f"no reward function for data_source {data_source!r}; built-in sources are "
            f"{known_data_sources()}. For another source, write fn(data_source, solution_str, "
            "ground_truth, extra_info) -> float | dict in a Python file and set "
            "custom_reward_function.path (and custom_reward_function.name) to it."
        ) from None


_LOADS = itertools.count()
_ADDED_DIRS: list[str] = []  # the reward file's folder this loader put on sys.path (the last one loaded)
_BESIDE: set[str] = set()  # the modules the last reward file loaded imported from beside it (``helper``)
_REWARD_MODULES: set[str] = set()  # the names the reward files themselves are registered under
_PROJECT = frozenset({"rlhf_core", "steps", "pipelines"})  # never imported anew: one copy of the project's classes


def _beside(names, directory: str) -> set[str]:
    """Of the modules ``names``, those whose top-level module was found in ``directory`` itself: a module file
    there (``helper.py``) or a package folder there, with its submodules; not this project's, nor a reward module
    itself, nor what an environment inside the folder installed (``.venv/lib/.../site-packages``: such a package
    is not the user's, and some cannot be imported twice in a process)."""
    def found_there(top: str) -> bool:
        module = sys.modules.get(top)
        where = getattr(module, "__file__", None)
        folder = os.path.join(directory, top)
        return (isinstance(where, str) and os.path.dirname(where) in (directory, folder)) \
            or folder in list(getattr(module, "__path__", None) or [])

    return {name for name in names if name not in _REWARD_MODULES and name.partition(".")[0] not in _PROJECT
            and found_there(name.partition(".")[0])}


_CUSTOM_MODULE = "_custom_reward_"


def custom_module_name(file: str | Path) -> str:
    """The module name of a custom reward file, the same for every load of that path (each load registers
    ``<this>_<n>``): what the reward spec names its functions by."""
    return _CUSTOM_MODULE + hashlib.sha1(str(Path(file).expanduser().resolve()).encode()).hexdigest()[:12]


def spec_module_name(module: str) -> str:
    """A module's name as the reward spec writes it: a loaded copy of a custom reward file
    (``<custom_module_name>_<n>``) by the file's one name, any other module by its own."""
    base, _, copy = module.rpartition("_")
    return base if base.startswith(_CUSTOM_MODULE) and copy.isdigit() else module


def load_custom_reward_fn(path: str | Path, name: str = "compute_score",
                          reward_kwargs: Mapping[str, Any] | None = None) -> RewardFn:
    """Load the function ``name`` from the Python file ``path``; with ``reward_kwargs``, the function with
    those keyword arguments bound (a :func:`functools.partial`), as verl's ``reward_kwargs`` give them.

    The file runs as a fresh module on each call (module-level state starts anew), with its directory on
    ``sys.path`` (last, in place of an earlier reward file's) so that it imports the modules beside it as a script
    does, anew on each call (a helper edited since, or another folder's module of the same name, is not the one
    imported before), and each stays registered
    in ``sys.modules`` under a name of its own (so that what it defines pickles by reference, as a
    ``multiprocessing`` pool inside the reward needs). Raises
    FileNotFoundError (no such file), ImportError (the file fails to run), AttributeError (no ``name`` in
    it; the message lists the functions it does define) or TypeError (``name`` is not callable, or does
    not take the ``reward_kwargs``). The return type is checked when the function is used, by the reward
    manager.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        hint = " (it is a folder; give the .py file)" if file.is_dir() else ""
        raise FileNotFoundError(
            f"custom reward function file {str(file)!r} not found{hint}; "
            "check custom_reward_function.path (relative paths resolve against the working directory "
            f"{str(Path.cwd())!r})"
        )
    # a fresh module each load (its own module-level state), under a name of its own that stays registered, so
    # that every copy's functions pickle by reference (a multiprocessing pool's workers look them up by name)
    module_name = f"{custom_module_name(file)}_{next(_LOADS)}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(
            f"cannot load {str(file)!r} as a Python module; custom_reward_function.path must be a .py file"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    _REWARD_MODULES.add(module_name)
    # the modules beside it import as a script's do (``from helper import f``), whatever the current directory or
    # entry point; after the others on the path, so that a file beside it never hides a package of that name. What
    # the reward loaded before imported from beside it is imported anew (another folder's helper.py of the same name,
    # or the same one edited since), and that reward's folder, where this loader put it on the path, leaves it
    directory = str(file.resolve().parent)
    # (with what a reward imported from its folder later, inside its function: a folder this loader put on the path)
    for imported in _BESIDE.union(*(_beside(list(sys.modules), added) for added in _ADDED_DIRS)):
        sys.modules.pop(imported, None)
    _BESIDE.clear()
    sys.path[:] = [entry for entry in sys.path if entry not in _ADDED_DIRS or entry == directory]
    _ADDED_DIRS[:] = [entry for entry in _ADDED_DIRS if entry == directory]
    if directory not in sys.path:
        sys.path.append(directory)
        _ADDED_DIRS.append(directory)
    before = set(sys.modules)
    try:
        # the file's bytes now, compiled here: the loader's bytecode cache trusts a .pyc whose source has the same
        # size and modification second, so a file edited within that second ran as it was before
        exec(compile(file.read_bytes(), spec.origin, "exec", dont_inherit=True), module.__dict__)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ImportError(
            f"running custom reward file {str(file)!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:  # (what it imported before it failed, too)
        _BESIDE.update(_beside(set(sys.modules) - before, directory))

    if not hasattr(module, name):
        defined = sorted(
            attr
            for attr, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module_name and not attr.startswith("_")
        )
        listing = ", ".join(defined) if defined else "none"
        raise AttributeError(
            f"custom reward file {str(file)!r} has no function {name!r}; functions it defines: {listing}. "
            "Set custom_reward_function.name to one of them."
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(
            f"{name!r} in custom reward file {str(file)!r} is a {type(fn).__name__}, not a function; "
            "it must be fn(data_source, solution_str, ground_truth, extra_info) -> float | dict"
        )
    if not reward_kwargs:
        return fn
    try:
        inspect.signature(fn).bind_partial(**reward_kwargs)
    except TypeError as exc:
        raise TypeError(f"custom_reward_function.reward_kwargs {dict(reward_kwargs)} do not fit {name!r} in "
                        f"{str(file)!r}: {exc}") from None
    return functools.partial(fn, **reward_kwargs)


class BatchRewardFn:
    """A reward function of whole batches, as verl's ``reward_model.reward_manager=batch`` calls it:
    ``fn(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...]) -> list`` of one
    number or dict per response (or a dict of them keyed by position 0 .. n-1, which verl reads alike). The
    reward manager calls :meth:`score_batch` once a batch; called as a per-response function (the reference
    check) it scores a batch of one."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def score_batch(self, data_sources: list, solution_strs: list, ground_truths: list, extra_infos: list) -> list:
        from rlhf_core.rewards.result import awaited  # (imports torch, which this module does not)

        results = awaited(self.fn(data_sources=data_sources, solution_strs=solution_strs,
                                  ground_truths=ground_truths, extra_infos=extra_infos))
        if isinstance(results, Mapping):  # list() would take its keys for the scores
            results = self._by_position(results, len(solution_strs))
        if isinstance(results, (str, bytes)):  # list() would take its characters for the scores
            raise TypeError(f"batch reward function {_name(self.fn)!r} returned {type(results).__name__} "
                            f"{results[:40]!r}, not a list of {len(solution_strs)} scores")
        try:
            results = list(results)
        except TypeError:
            raise TypeError(f"batch reward function {_name(self.fn)!r} returned {type(results).__name__}, not a "
                            f"list of {len(solution_strs)} scores") from None
        if len(results) != len(solution_strs):
            raise TypeError(f"batch reward function {_name(self.fn)!r} returned {len(results)} scores for "
                            f"{len(solution_strs)} responses")
        return results

    def _by_position(self, results: Mapping, count: int) -> list:
        """The scores of a dict keyed by the responses' positions 0 .. count-1, in order: verl's batch manager reads
        ``scores[i]`` for each position ``i``, so such a dict scores there as a list does. Any other dict is a
        TypeError naming the keys it has and the keys expected."""
        if set(results) == set(range(count)):
            return [results[i] for i in range(count)]
        keys = ", ".join(repr(key) for key in itertools.islice(results, 5)) + (", ..." if len(results) > 5 else "")
        what = f"a dict (keys {keys})" if results else "an empty dict"
        expected = "0" if count == 1 else f"0 to {count - 1}"
        raise TypeError(f"batch reward function {_name(self.fn)!r} returned {what}, not a list of {count} scores "
                        f"nor a dict keyed by position ({expected}): return one number or dict per response, in the "
                        "order of solution_strs, e.g. [{'score': 1.0}, ...] rather than {'score': [1.0, ...]}")

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        return self.score_batch([data_source], [solution_str], [ground_truth], [extra_info])[0]


def _name(fn: Callable[..., Any]) -> str:
    return getattr(getattr(fn, "func", fn), "__name__", repr(fn))


def custom_reward_fn(cfg: PPOConfig) -> RewardFn | None:
    """The function that ``custom_reward_function`` (its path, name and reward_kwargs) names, as a
    :class:`BatchRewardFn` under ``reward_model.reward_manager=batch``; None where it names none (the
    built-in rules by data source)."""
    custom = cfg.custom_reward_function
    if not custom.path:
        return None
    fn = load_custom_reward_fn(custom.path, custom.name, custom.reward_kwargs)
    batch = cfg.reward_model.reward_manager == "batch"
    _check_call(fn, BATCH_KEYWORDS if batch else KEYWORDS, custom.name, custom.path,
                "reward_model.reward_manager=batch" if batch else "each response")
    return BatchRewardFn(fn) if batch else fn


KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")  # how the reward manager calls a function
BATCH_KEYWORDS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def _check_call(fn: Callable[..., Any], keywords: tuple[str, ...], name: str, path: str, how: str) -> None:
    """A TypeError, before any model loads, where ``fn`` cannot take the keyword arguments the reward manager
    calls it with (it failed at the first batch, after the models loaded and generated)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an extension without a signature: the call will tell
        return
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as exc:
        raise TypeError(f"{name!r} in {str(path)!r} cannot be called as the reward manager calls it for {how}, "
                        f"fn({', '.join(k + '=...' for k in keywords)}): {exc}") from None


__all__ = [
    "REWARD_FNS",
    "BatchRewardFn",
    "RewardFn",
    "UnknownDataSourceError",
    "get_reward_fn",
    "gsm8k_reward",
    "known_data_sources",
    "custom_reward_fn",
    "load_custom_reward_fn",
    "spec_module_name",
]
