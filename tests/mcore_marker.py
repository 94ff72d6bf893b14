"""Which test modules reach megatron-core: the ``mcore`` marker, computed, never listed by hand.

A test module reaches megatron-core when, following its imports statically and transitively,
some module imports ``megatron``. Followed: every ``import``/``from ... import`` statement
anywhere in a file (function-local ones included), relative imports, ``importlib.import_module``
and ``__import__`` of a literal or of ``f"{__name__}.{...}"`` (a package's lazy ``__getattr__``:
every module of that package, or the one named), ``pytest.importorskip``; through the test
helpers (imported by bare name from any folder of ``tests/``, or as ``tests.x``), the package's
modules, and the programs a test starts: a string outside the package naming a module of the package
or of ``megatron`` (``python -m emapg_megatron.train``) and a script under ``examples/`` or
``tools/`` (``.sh``: the modules it runs with ``-m``, its ``import`` lines (``python -c``, heredocs),
the console scripts it calls and the files it sources; ``.py``: its imports). Strings in the
package's own modules are data (a warning filter naming a megatron module imports nothing). Third-party modules are not followed (none of them imports megatron-core).

``python tests/mcore_marker.py`` lists every test module with its verdict and, for one that
reaches megatron-core, the chain of files that does.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
PACKAGE = "emapg_megatron"
MEGATRON = "megatron"
SCRIPT_DIRS = ("", "examples", "tools")

_MODULE_NAME = re.compile(r"^(?:emapg_megatron|megatron)(?:\.\w+)*$")
_SHELL_MODULE = re.compile(r"-m\s+((?:emapg_megatron|megatron)(?:\.\w+)*)")
_SHELL_IMPORT = re.compile(r"(?:^|[\s;\"'])(?:from\s+([\w.]+)\s+import|import\s+([\w., ]+))", re.M)
_SHELL_SOURCE = re.compile(r"(?:^|[\s;])(?:source|\.)\s+\"?\$\(dirname \"?\$0\"?\)/([\w./-]+)\"?", re.M)
_CONSOLE = {"emapg-train": "emapg_megatron.launch", "emapg_train": "emapg_megatron.launch",
            "emapg-convert": "emapg_megatron.checkpoint.cli",
            "emapg_convert": "emapg_megatron.checkpoint.cli",
            "emapg-evaluate": "emapg_megatron.evaluate", "emapg_evaluate": "emapg_megatron.evaluate"}


def _helper_dirs() -> list[str]:
    """Where bare helper names resolve: tests/ and each of its folders (conftest.py's sys.path)."""
    return [TESTS, *sorted(os.path.join(TESTS, d) for d in os.listdir(TESTS)
                           if not d.startswith((".", "_")) and os.path.isdir(os.path.join(TESTS, d)))]


def module_file(name: str) -> str | None:
    """The file of module ``name`` in this repository (the package, tests.*, a bare helper)."""
    parts = name.split(".")
    roots = [ROOT] if parts[0] in (PACKAGE, "tests", "tools") else _helper_dirs()
    for root in roots:
        base = os.path.join(root, *parts)
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def _module_name(path: str) -> str | None:
    """The dotted name of a module of the repository (``__name__`` in it), else None."""
    rel = os.path.relpath(path, ROOT)
    if rel.startswith(".."):
        return None
    parts = rel[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or None


def _package_of(path: str) -> str | None:
    """The dotted package a file of the repository is in (for relative imports), else None."""
    rel = os.path.relpath(path, ROOT)
    return None if rel.startswith("..") else ".".join(rel.split(os.sep)[:-1]) or None


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _submodules(package: str) -> list[str]:
    """Every module under a package's folder (a lazy loader may hand out any of them)."""
    init = module_file(package)
    if init is None or not init.endswith("__init__.py"):
        return []
    folder, out = os.path.dirname(init), []
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        prefix = package + "".join("." + p for p in os.path.relpath(dirpath, folder).split(os.sep) if p != ".")
        out += [f"{prefix}.{f[:-3]}" for f in files if f.endswith(".py") and f != "__init__.py"]
    return out


def _dynamic_target(node: ast.Call, name: str | None) -> list[str]:
    """The modules an ``import_module``/``__import__``/``importorskip`` call in module ``name``
    may load."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called not in ("import_module", "__import__", "importorskip") or not node.args:
        return []
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and name:
        head = arg.values[0] if arg.values else None
        if isinstance(head, ast.FormattedValue) and getattr(head.value, "id", None) == "__name__":
            rest = arg.values[1:]
            if len(rest) == 1 and isinstance(rest[0], ast.Constant):  # f"{__name__}.distributed"
                return [name + rest[0].value]
            return _submodules(name)  # f"{__name__}.{_LAZY[name]}": any of them
    return []


def _script_file(text: str, here: str) -> str | None:
    if not text.endswith((".sh", ".py")) or "\n" in text or len(text) > 200:
        return None
    for base in (os.path.dirname(here), *(os.path.join(ROOT, d) for d in SCRIPT_DIRS)):
        path = os.path.normpath(os.path.join(base, text))
        if os.path.isfile(path) and (path.startswith(os.path.join(ROOT, "examples"))
                                     or path.startswith(os.path.join(ROOT, "tools"))):
            return path
    return None


def _nodes(tree: ast.AST, eager: bool):
    """Every node of ``tree``; with ``eager``, not those of a module-level ``__getattr__`` (a lazy
    loader runs only when a name of the module is asked for, not when a submodule is imported)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not (eager and node is tree and isinstance(child, ast.FunctionDef)
                    and child.name == "__getattr__"):
                todo.append(child)


@functools.lru_cache(maxsize=None)
def dependencies(path: str, eager: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(module names, script files) that the file at ``path`` imports or starts; with ``eager``,
    only what it imports when it is loaded as the parent package of a submodule being imported."""
    if path.endswith(".sh"):
        return _shell_dependencies(path)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = _package_of(path)
    in_package = path.startswith(os.path.join(ROOT, PACKAGE) + os.sep)  # its strings are data
    names, scripts = [], []
    for node in _nodes(tree, eager):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if not package:
                    continue
                base_parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call):
            names += _dynamic_target(node, _module_name(path))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and not in_package:
            if _MODULE_NAME.match(node.value):
                names.append(node.value)
            elif (script := _script_file(node.value, path)) is not None:
                scripts.append(script)
    return tuple(names), tuple(scripts)


def _shell_dependencies(path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    names = _SHELL_MODULE.findall(text)
    for source, imported in _SHELL_IMPORT.findall(text):  # python -c "import ..." and heredocs
        names += [source] if source else [n.strip() for n in imported.split(",") if n.strip()]
    names += [module for command, module in _CONSOLE.items() if re.search(rf"(?<![\w-]){command}\b", text)]
    scripts = [os.path.normpath(os.path.join(os.path.dirname(path), s)) for s in _SHELL_SOURCE.findall(text)]
    return tuple(names), tuple(s for s in scripts if os.path.isfile(s))


@functools.lru_cache(maxsize=None)
def megatron_chain(path: str) -> tuple[str, ...] | None:
    """The chain of files from ``path`` to an import of megatron-core, or None if none exists.

    A module named by an import is followed whole; the packages above it only as far as loading
    them goes (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__``, not their lazy
    ``__getattr__``: that runs when a name of the package itself is imported or asked for)."""
    start = (path, False)
    seen, todo = {start: None}, [start]
    while todo:
        current = todo.pop()
        names, scripts = dependencies(*current)
        found = []
        for name in names:
            if name.split(".")[0] == MEGATRON:
                chain = [name]
                at = current
                while at is not None:
                    chain.append(at[0])
                    at = seen[at]
                return tuple(reversed(chain))
            candidates = _with_parents(name)
            for k, candidate in enumerate(candidates):
                if (file := module_file(candidate)) is not None:
                    found.append((file, k < len(candidates) - 1))
        for key in [*found, *((s, False) for s in scripts)]:
            if key not in seen:
                seen[key] = current
                todo.append(key)
    return None


def reaches_megatron(path: str) -> bool:
    return megatron_chain(os.path.abspath(path)) is not None


def _relative(path: str) -> str:
    return path if not os.path.isabs(path) else os.path.relpath(path, ROOT)


if __name__ == "__main__":
    for folder, dirs, files in sorted(os.walk(TESTS)):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in sorted(files):
            if name.startswith("test_") and name.endswith(".py"):
                chain = megatron_chain(os.path.join(folder, name))
                print(f"{'mcore' if chain else '-    '} {_relative(os.path.join(folder, name))}"
                      + (f"  ({' -> '.join(_relative(c) for c in chain[1:])})" if chain else ""))
    sys.exit(0)
