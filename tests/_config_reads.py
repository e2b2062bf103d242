"""Which keys of a config tree the library reads: a static pass over source code, used by
``tests/trainer/test_config_contract.py`` to find keys that are defined but do nothing.

What counts as reading a key, e.g. ``worker.ref.offload.offload_params`` (per section: the actor's
``offload.offload_params`` being read says nothing about the ref's):

1. An attribute chain from a *root*: a parameter annotated with the root class (``config: PPOConfig``),
   e.g. ``config.worker.ref.offload.offload_params``.
2. Through names bound to part of a chain: ``ref_cfg = config.worker.ref`` (``a if c else b`` and
   ``a or b`` bind both), and through objects: ``self.x = ...`` binds ``x`` on every object of the
   class, wherever it is reached (``self.actor.config.x``, or ``role.config.x`` in a function that was
   handed the object as ``role``).
3. A section passed whole (positionally or by keyword) to a function or constructor whose parameter
   is annotated with a config class (``fsdp: FSDPConfig``): the keys that function reads from that
   parameter, by these same rules, count as read in the section passed. Callees are found by name.
4. A property or method of a config class (``model.tokenizer_or_model_path``) counts for the keys it
   reads from ``self``, in the section where it is used.
5. ``getattr(section, "name")``, and ``getattr(section, key)`` where ``key`` runs over a literal tuple
   of names or a module-level tuple constant of names.
6. A parameter annotated with a config class that sits at exactly one place in the tree (a section's
   class, or a base class of only that section's class, e.g. ``PolicyLossConfig`` under
   ``worker.actor``): what the function reads from it counts as read in that section, wherever it is
   called from. A function reached through a registry (``POLICY_LOSSES[name](..., options)``) cannot be
   followed by name, but the section it is handed can only be that one.

Nothing else counts: not ``asdict(config)``, not a section handed to a parameter without a config
annotation, not the loader, the file checks or a section's ``check`` (checking a value is not using it).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from collections import defaultdict
from collections.abc import Iterator

ABSOLUTE = ""  # the root id of paths that start at the root class
OBJECT = "object:"  # root id prefix of an object of a (non-config) class: OBJECT + class name
PathSet = set[tuple[str, tuple[str, ...]]]  # (root id, attribute names from that root)


def config_classes(root: type) -> dict[str, type]:
    """Every dataclass of the tree, by name (base classes of sections included)."""
    found: dict[str, type] = {}

    def visit(cls: type) -> None:
        for klass in cls.__mro__:
            if dataclasses.is_dataclass(klass):
                found[klass.__name__] = klass
        for hint in typing.get_type_hints(cls).values():
            if dataclasses.is_dataclass(hint):
                visit(hint)

    visit(root)
    return found


def section_paths(root: type) -> dict[str, set[tuple[str, ...]]]:
    """Class name -> the paths of the sections whose class is it or derives from it (``()``: the root)."""
    paths: dict[str, set[tuple[str, ...]]] = defaultdict(set)

    def visit(cls: type, path: tuple[str, ...]) -> None:
        for klass in cls.__mro__:
            if dataclasses.is_dataclass(klass):
                paths[klass.__name__].add(path)
        for name, hint in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(hint):
                visit(hint, path + (name,))

    visit(root, ())
    return paths


def schema_leaves(cls: type, prefix: str = "") -> Iterator[str]:
    """Dotted keys of the tree's leaves (a free-form dict is one leaf)."""
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            yield from schema_leaves(hint, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


@dataclasses.dataclass
class _Function:
    root_id: str  # prefix of the root ids of its config-typed parameters
    node: ast.FunctionDef | ast.AsyncFunctionDef
    class_name: str | None
    params: list[str]  # callable parameters (``self``/``cls`` of a method left out)
    config_params: dict[str, str]  # parameter name -> root id (config-annotated parameters only)


class _Analysis:
    def __init__(self, root: type, sources: dict[str, str]):
        self.classes = config_classes(root)
        # rule 6: classes at exactly one place in the tree, with that place
        self.unique_sections = {
            name: next(iter(paths)) for name, paths in section_paths(root).items() if len(paths) == 1
        }
        self.class_pattern = re.compile(r"\b(" + "|".join(map(re.escape, self.classes)) + r")\b")
        self.root_name = root.__name__
        self.functions: dict[str, list[_Function]] = defaultdict(list)  # by call name
        self.config_methods: dict[str, list[str]] = defaultdict(list)  # method name -> its self root ids
        self.constants: dict[str, set[str]] = {}  # module-level tuples of names
        self.reads: dict[str, set[tuple[str, ...]]] = defaultdict(set)  # root id -> paths read
        self.edges: dict[str, set[tuple[tuple[str, ...], str]]] = defaultdict(set)  # root -> (path, root)
        self.object_bindings: dict[str, dict[str, PathSet]] = defaultdict(lambda: defaultdict(set))
        self.param_objects: dict[tuple[str, str], PathSet] = defaultdict(set)  # objects handed to params
        self.object_classes: set[str] = set()
        trees = {module: ast.parse(text) for module, text in sources.items()}
        for module, tree in trees.items():
            self._collect(module, tree)
        for _ in range(4):  # bindings made in one function and used in another
            for functions in self.functions.values():
                for function in functions:
                    self._evaluate(function)

    # ---- declarations -------------------------------------------------------------------------

    def _collect(self, module: str, tree: ast.Module) -> None:
        for statement in tree.body:
            if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Tuple):
                names = _string_elements(statement.value)
                for target in statement.targets:
                    if isinstance(target, ast.Name) and names:
                        self.constants[target.id] = names
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self._register(module, item, node.name)
        methods = {
            id(item) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for item in node.body
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in methods:
                self._register(module, node, None)

    def _register(self, module: str, node: ast.FunctionDef | ast.AsyncFunctionDef, class_name: str | None):
        root_id = f"{module}:{class_name or ''}.{node.name}@{node.lineno}"
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        is_method = class_name is not None and not any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list
        )
        config_params = {}
        for argument in arguments:
            classes = set(self.class_pattern.findall(ast.unparse(argument.annotation or ast.Constant(""))))
            if self.root_name in classes:
                config_params[argument.arg] = ABSOLUTE
            elif classes:
                config_params[argument.arg] = f"{root_id}:{argument.arg}"
                for name in classes & self.unique_sections.keys():  # rule 6
                    self.edges[ABSOLUTE].add((self.unique_sections[name], config_params[argument.arg]))
        if is_method and class_name in self.classes and arguments:
            # a config class's own method: reads from `self` count where it is used (rule 4)
            config_params[arguments[0].arg] = f"{root_id}:{arguments[0].arg}"
            self.config_methods[node.name].append(config_params[arguments[0].arg])
        params = [a.arg for a in arguments[1:]] if is_method and arguments else [a.arg for a in arguments]
        if is_method and class_name not in self.classes and arguments:
            self.object_classes.add(class_name)
            self.param_objects[root_id, arguments[0].arg].add((OBJECT + class_name, ()))
        function = _Function(root_id, node, class_name, params, config_params)
        call_name = class_name if class_name and node.name == "__init__" else node.name
        self.functions[call_name].append(function)

    # ---- one function -------------------------------------------------------------------------

    def _evaluate(self, function: _Function) -> None:
        env: dict[str, PathSet] = defaultdict(set)
        for name, root_id in function.config_params.items():
            env[name].add((root_id, ()))
        for name in function.node.args.args + function.node.args.kwonlyargs:
            env[name.arg] |= self.param_objects.get((function.root_id, name.arg), set())
        loops = _literal_loop_names(function.node, self.constants)
        for _ in range(4):  # bindings through bindings, in any statement order
            for node in ast.walk(function.node):
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        self._bind(target, node.value, env, loops)
        for node in ast.walk(function.node):
            if isinstance(node, ast.Attribute):
                self._record(self._resolve(node.value, env, loops), node.attr)
            elif isinstance(node, ast.Call):
                getattr_name = _getattr_names(node, loops)
                if getattr_name is not None:
                    base = self._resolve(node.args[0], env, loops)
                    for name in getattr_name:
                        self._record(base, name)
                self._call(node, env, loops)

    def _bind(self, target, value, env, loops) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for sub_target, sub_value in zip(target.elts, value.elts):
                self._bind(sub_target, sub_value, env, loops)
            return
        paths = self._resolve(value, env, loops)
        if not paths:
            return
        if isinstance(target, ast.Name):
            env[target.id] |= paths
        elif isinstance(target, ast.Attribute):
            for root, path in self._resolve(target.value, env, loops):
                if root.startswith(OBJECT) and not path:
                    self.object_bindings[root][target.attr] |= paths

    def _resolve(self, node, env, loops) -> PathSet:
        if isinstance(node, ast.Name):
            return set(env.get(node.id, ()))
        if isinstance(node, ast.Attribute):
            return self._attribute(self._resolve(node.value, env, loops), {node.attr})
        if isinstance(node, ast.Call):
            names = _getattr_names(node, loops)
            if names is not None:
                return self._attribute(self._resolve(node.args[0], env, loops), names)
            if isinstance(node.func, ast.Name) and node.func.id in self.object_classes:
                return {(OBJECT + node.func.id, ())}  # a constructor call
            return set()
        if isinstance(node, ast.IfExp):
            return self._resolve(node.body, env, loops) | self._resolve(node.orelse, env, loops)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self._resolve(v, env, loops) for v in node.values))
        return set()

    def _attribute(self, base: PathSet, names: set[str]) -> PathSet:
        paths = set()
        for root, path in base:
            for name in names:
                if root.startswith(OBJECT):  # an object's attribute: what was bound to it
                    paths |= self.object_bindings[root].get(name, set()) if not path else set()
                else:
                    paths.add((root, path + (name,)))
        return paths

    def _record(self, base: PathSet, attr: str) -> None:
        for root, path in base:
            if root.startswith(OBJECT):
                continue
            self.reads[root].add(path + (attr,))
            for method_root in self.config_methods.get(attr, ()):  # rule 4
                self.edges[root].add((path, method_root))

    def _call(self, node: ast.Call, env, loops) -> None:
        func = node.func
        name = (
            func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        )
        for callee in self.functions.get(name, ()):
            passed = [(callee.params[i], arg) for i, arg in enumerate(node.args) if i < len(callee.params)]
            passed += [(kw.arg, kw.value) for kw in node.keywords if kw.arg is not None]
            for param, arg in passed:
                values = self._resolve(arg, env, loops)
                self.param_objects[callee.root_id, param] |= {v for v in values if v[0].startswith(OBJECT)}
                target = callee.config_params.get(param)
                if target is None or target == ABSOLUTE:  # untyped: not a read; the root: read anyway
                    continue
                for root, path in values:
                    if not root.startswith(OBJECT):
                        self.edges[root].add((path, target))

    # ---- closure ------------------------------------------------------------------------------

    def read_paths(self, root_id: str = ABSOLUTE, visiting: frozenset = frozenset()) -> set[tuple[str, ...]]:
        """Paths read under ``root_id``, through every section passed on (rule 3) and property (rule 4)."""
        paths = set(self.reads.get(root_id, ()))
        for prefix, target in self.edges.get(root_id, ()):
            if target not in visiting:
                paths |= {prefix + rest for rest in self.read_paths(target, visiting | {root_id})}
        return paths


def _string_elements(node: ast.AST) -> set[str] | None:
    elements = node.elts if isinstance(node, (ast.Tuple, ast.List)) else []
    if elements and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elements):
        return {e.value for e in elements}
    return None


def _literal_loop_names(function: ast.AST, constants: dict[str, set[str]]) -> dict[str, set[str]]:
    """Loop variables (``for``, comprehensions) that run over a literal tuple of names (rule 5)."""
    names: dict[str, set[str]] = defaultdict(set)
    for node in ast.walk(function):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            values = _string_elements(node.iter)
            if values is None and isinstance(node.iter, ast.Name):
                values = constants.get(node.iter.id)
            if values:
                names[node.target.id] |= values
    return names


def _getattr_names(node: ast.Call, loop_names: dict[str, set[str]]) -> set[str] | None:
    if not (isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2):
        return None
    key = node.args[1]
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return {key.value}
    if isinstance(key, ast.Name) and key.id in loop_names:
        return loop_names[key.id]
    return None


def read_keys(root: type, sources: dict[str, str]) -> set[str]:
    """Dotted paths under ``root`` that the code in ``sources`` (module name -> text) reads."""
    return {".".join(path) for path in _Analysis(root, sources).read_paths()}


def unread_keys(root: type, sources: dict[str, str]) -> list[str]:
    """The leaves of ``root``'s tree that nothing in ``sources`` reads, in schema order."""
    read = read_keys(root, sources)
    return [key for key in schema_leaves(root) if key not in read]
