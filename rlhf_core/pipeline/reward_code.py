"""A custom reward's code as the reward spec pins it (:func:`~rlhf_core.pipeline.evaluate.reward_spec`): its files and
the modules they import from beside it, read without comments or layout; what they take from this project, as its
source; the installed distributions they import, by version; and a function's own source with what it reaches in
its file. Nothing here imports torch, so that reading a version's lineage (which checks these again) does not."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PROJECT = __name__.partition(".")[0]  # this project's top-level package (rlhf_core)


def _top_level_sources(path: str) -> dict[str, str]:
    """Each name a file's top level binds (assignment, ``def`` with its decorators, ``class``), with the source
    of the statements that bind it."""
    source = Path(path).read_text()
    lines = source.splitlines()
    bound: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)]
        else:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        text = "\n".join(lines[first - 1:node.end_lineno])
        for name in names:
            bound.setdefault(name, []).append(text)
    return {name: "\n".join(texts) for name, texts in bound.items()}


def _names_in(source: str) -> list[str]:
    """The names a piece of source reads or binds, in order, once each."""
    tree = ast.parse(textwrap.dedent(source))
    return list(dict.fromkeys(node.id for node in ast.walk(tree) if isinstance(node, ast.Name)))


def source_closure(fn: Callable) -> str:
    """What decides the function's behaviour, as source text: its own; that of every top-level statement of its
    file that binds a name it reads (helpers, their decorators, classes, constants: as written, so a value made
    at import, such as the module's ``__name__``, does not enter), and of theirs in turn; and the source of the
    modules, functions and classes it names from elsewhere. Comments and code outside of these do not enter it."""
    own = inspect.getsource(fn)
    parts = [own]
    scope = getattr(fn, "__globals__", {})
    try:
        home = _top_level_sources(inspect.getsourcefile(fn))
        todo = _names_in(own)
    except (OSError, TypeError, SyntaxError):  # no readable file, or a lambda's line that is not a statement
        home, todo = {}, list(dict.fromkeys(fn.__code__.co_names))
    seen = {fn.__name__}
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        if name in home:
            parts.append(home[name])
            todo.extend(_names_in(home[name]))
        elif isinstance(target := scope.get(name), types.ModuleType) or inspect.isfunction(target) \
                or inspect.isclass(target):
            parts.append(_source_or_name(target))
    return "\n".join(parts)


def user_code(path: Path, cwd: Path | None = None) -> tuple[str, set[str], dict[Path, bytes]]:
    """A custom reward file's code without its comments or layout (its syntax tree written back), and that of
    each module it imports from beside it, in turn. Any change to the code counts, even to code the reward may
    not reach (its production results are then evaluated again, where a missed change would grade the
    candidate and production by different rules). What these files import from this project enters as its
    source (:func:`_project_source`), whatever the current directory: its checkout there is not the user's
    code, and its files' imports are not the reward's packages. With it, the top-level names (of a namespace
    package that several distributions fill, the part imported) of the other modules these files import, neither
    the user's own (a module or a directory, a namespace package, beside the reward or in the current directory)
    nor the standard library's nor this project's: code the text does not hold, which
    :func:`installed_versions` pins by its version. Third, the bytes of each of the user's files it read (the reward file first), by path.

    ``cwd``: the current directory to find the user's modules in (default: this process's), so that a check made
    later, from elsewhere, reads the same files."""
    path = path.expanduser().resolve()
    root, parts, seen, todo, imported, ours = path.parent, [], set(), [path], set(), {}
    absolute = [root, cwd or Path.cwd()]  # where an absolute import of the user's own modules is found
    files: dict[Path, bytes] = {}
    project = _project_packages()
    while todo:
        file = todo.pop(0)
        if file in seen:
            continue
        seen.add(file)
        files[file] = file.read_bytes()
        tree = ast.parse(files[file], filename=str(file))
        parts.append(f"# {file.relative_to(root) if file.is_relative_to(root) else file.name}\n{ast.unparse(tree)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names, bases = [alias.name for alias in node.names], absolute
                imported.update(names)
                ours.update({name: (name, None) for name in names if name.partition(".")[0] in project})
                names = [name for name in names if name.partition(".")[0] not in project]  # found by its source
            elif isinstance(node, ast.ImportFrom):
                bases = [file.parents[node.level - 1]] if node.level else absolute
                names = ([node.module] if node.module else []) + [
                    f"{node.module}.{alias.name}" if node.module else alias.name for alias in node.names]
                if not node.level:  # the names too: of a namespace package, they may be what one distribution provides
                    imported.update(f"{node.module}.{a.name}" if a.name != "*" else node.module for a in node.names)
                    if node.module.partition(".")[0] in project:  # found by its source, not as the user's files
                        ours.update({f"{node.module}.{a.name}": (node.module, a.name) for a in node.names})
                        names = []
            else:
                continue
            for base in bases:
                for name in names:
                    pieces = name.split(".")
                    # each package on the way runs its __init__.py first (import a.b.c runs a's and a.b's)
                    todo += [f for depth in range(1, len(pieces))
                             if (f := base.joinpath(*pieces[:depth], "__init__.py")).is_file()]
                    stem = base.joinpath(*pieces)
                    todo += [f for f in (stem.with_suffix(".py"), stem / "__init__.py") if f.is_file()]
    parts += [f"# {dotted}\n{_project_source(*ours[dotted])}" for dotted in sorted(ours)]
    tops = {name.partition(".")[0] for name in imported}
    others = {top for top in tops - set(sys.stdlib_module_names) - project if not _users(top, absolute)}
    provides = importlib.metadata.packages_distributions()
    packages = {_package_part(name, provides) for name in imported if name.partition(".")[0] in others}
    return "\n".join(parts), packages, files


def _users(name: str, bases: list[Path]) -> bool:
    """Whether top-level module ``name`` is the user's own: a module or package beside the reward or in the
    current directory, or a directory there (a namespace package) that no installed package of that name wins
    over (Python imports an installed regular package before a namespace directory)."""
    if any((base / f"{name}.py").is_file() or (base / name / "__init__.py").is_file() for base in bases):
        return True
    if not any((base / name).is_dir() for base in bases):
        return False
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return True
    return spec is None or spec.origin is None  # no origin: the namespace directory itself


@functools.cache
def _project_packages() -> frozenset[str]:
    """This project's top-level packages (``rlhf_core``, ``steps``, ``pipelines``): those that only its
    distribution provides, or ``rlhf_core`` alone where it is not installed. (Looked up once: which packages
    the running project's code is made of does not change while it runs.)"""
    provides = importlib.metadata.packages_distributions()
    project = set(provides.get(_PROJECT, ()))
    return frozenset({_PROJECT} | {name for name, dists in provides.items() if dists and set(dists) <= project})


def _project_source(module: str, name: str | None) -> str:
    """What ``import module`` (``name`` None) or ``from module import name`` takes from this project, found as
    Python finds it (an attribute of the module, else its submodule): a module's code without its comments or
    layout (its syntax tree written back), a function's or class's :func:`source_closure`, and for any other
    value the code of the module it comes from. Where it is not found (an import that fails here, a module
    without source), its dotted name: the spec is still made, and the reward fails at that import where it runs."""
    dotted = f"{module}.{name}" if name else module
    try:  # this project's own modules, which it is safe to import here
        home = target = importlib.import_module(module)
        if name and name != "*":
            target = getattr(home, name) if hasattr(home, name) else importlib.import_module(dotted)
        if inspect.isfunction(target) or inspect.isclass(target):
            return source_closure(target)
        source = inspect.getsource(target if isinstance(target, types.ModuleType) else home)
        return ast.unparse(ast.parse(source))
    except Exception:  # whatever a module's import or source lookup raises leaves its name
        return dotted


def _package_part(name: str, provides: dict[str, list[str]]) -> str:
    """What of an imported module's dotted name one installed distribution provides: its top-level package, or
    where several distributions fill that package (a namespace such as ``google``), the shortest part of the
    name that fewer of them hold, and so on down while several still share it (``google.protobuf``: protobuf
    alone, not google-auth beside it; ``google.cloud.storage``: not every ``google.cloud`` distribution)."""
    parts = name.split(".")
    depth, dists = 1, set(provides.get(parts[0], ()))
    while len(dists) > 1 and depth < len(parts):
        holding = _holding(dists, parts[:depth + 1])
        if not holding:  # the rest names something inside a module, not a module of its own
            break
        dists, depth = holding, depth + 1
    return ".".join(parts[:depth])


def _holding(dists, parts: list[str]) -> set[str]:
    """Those of ``dists`` with files under the module ``parts`` (``a/b/`` or ``a/b.py``, ``a/b.so``, ...)."""
    inside = ("/".join(parts) + "/", "/".join(parts) + ".")
    return {dist for dist in dists if any(str(file).startswith(inside) for file in importlib.metadata.files(dist) or ())}


def _providers(name: str, provides: dict[str, list[str]]) -> list[str]:
    """The distributions that provide ``name`` (a top-level package, or a namespace's part, :func:`_package_part`):
    of a namespace's distributions, those whose files lie under the part (all of them where none says)."""
    parts = name.split(".")
    dists = set(provides.get(parts[0], ()))
    return sorted((_holding(dists, parts) if len(parts) > 1 else set()) or dists)


def installed_versions(modules: set[str]) -> dict[str, Any]:
    """For each top-level module (or namespace part, :func:`_package_part`), the installed distributions that
    provide it with their versions (an upgrade of one may change what the reward gives, in code the reward's text
    does not hold), or ``"not installed"`` (the reward fails at that import, where it runs it). This project's own
    packages are left out: its version changes at each of its releases, and production would be evaluated again
    every time, although the reward reaches little of what changed (what the reward imports of it is hashed by its
    source)."""
    if not modules:
        return {}
    provides = importlib.metadata.packages_distributions()
    project = _project_packages()
    return {name: {dist: importlib.metadata.version(dist) for dist in _providers(name, provides)}
            or "not installed" for name in sorted(modules) if name.partition(".")[0] not in project}


def _source_or_name(target: Any) -> str:
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):  # built-in or C modules have no source
        return getattr(target, "__name__", repr(target))


def called_functions(fn: Callable) -> list[Callable]:
    """Functions the body reaches as ``module.name`` (``gsm8k.compute_score``) or by a global name."""
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", {})
    names = code.co_names if code else ()
    found = []
    for position, name in enumerate(names):
        target = scope.get(name)
        if inspect.isfunction(target):
            found.append(target)
        elif isinstance(target, types.ModuleType) and position + 1 < len(names):
            attribute = getattr(target, names[position + 1], None)
            if inspect.isfunction(attribute):
                found.append(attribute)
    return found


def reward_identity(fn: Callable, custom_path: str | None, custom_name: str | None) -> str:
    """The reward function's name: a custom file's path and the configured name (what it is bound to there,
    whatever it is: a function, a lambda, a callable object), else the built-in function's module and name."""
    if custom_path:
        return f"{Path(custom_path).expanduser().resolve()}:{custom_name}"
    return f"{fn.__module__}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def keyword_defaults(fn: Callable) -> dict[str, Any]:
    defaults = {}
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.default is not inspect.Parameter.empty and name != "extra_info":
            value = parameter.default
            defaults[name] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return defaults
