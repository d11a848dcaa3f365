"""The shape of the code: rooms small enough to read, imports one way, privates kept private,
wire messages declared once.

These read the source (`ast`), so they fail on the commit that breaks a rule, not on the one
that later trips over it. Each failure names the files and what to do.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "potluck"
# A source file a newcomer can hold in their head; the Optimizer's front is smaller still: it
# keeps only the torch API, and each training mode is its own module.
MAX_LINES = 900
MAX_OPTIMIZER_LINES = 400


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in modules().items()}


def imported(name: str, path: Path, tree: ast.Module, known: set[str]) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) for every import of a potluck module in `tree`, wherever it
    is (top level, functions, TYPE_CHECKING blocks): each is a dependency of the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.append((f"{base}.{alias.name}", []))
                elif base in known:
                    found.append((base, [alias.name]))
    return found


def test_no_source_file_is_longer_than_a_reader_can_hold():
    long = {str(p.relative_to(SRC)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these files (at most {MAX_LINES} lines each): {long}"
    front = len((PACKAGE / "optim" / "optimizer.py").read_text().splitlines())
    assert front < MAX_OPTIMIZER_LINES, f"optim/optimizer.py has {front} lines: the training modes belong in their modules"


def test_no_module_imports_another_modules_private_names():
    known = set(modules())
    bad = [f"{name} imports {source}.{n}" for name, path in modules().items()
           for source, names in imported(name, path, ast.parse(path.read_text()), known)
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "make these public (or move the code that needs them): " + "; ".join(bad)


def test_no_import_circle_between_modules():
    known = set(modules())
    graph = {name: {m for m, _ in imported(name, path, ast.parse(path.read_text()), known) if m != name}
             for name, path in modules().items()}
    circles = _circles(graph)
    assert not circles, ("these modules import each other (directly or around a circle): "
                         + "; ".join(" -> ".join(c) for c in circles)
                         + ". Move what both need down a layer, or pass it in through an interface the lower one owns")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _private_attributes(tree: ast.Module) -> set[str]:
    """The private attribute names a module defines: methods and class attributes of its classes,
    and attributes its code assigns on `self`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets) \
                            and isinstance(item.value, (ast.Tuple, ast.List)):
                        names.update(e.value for e in item.value.elts if isinstance(e, ast.Constant))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                         and isinstance(t.value, ast.Name) and t.value.id == "self")
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_touches_another_modules_private_members():
    parsed = trees()
    defined = {name: _private_attributes(tree) for name, tree in parsed.items()}
    owners = defaultdict(set)
    for name, attributes in defined.items():
        for attribute in attributes:
            owners[attribute].add(name)
    bad = []
    for name, tree in parsed.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in defined[name] or node.attr not in owners:
                continue  # the module's own, or not potluck's (torch._foreach_add_, argparse's)
            bad.append(f"{name}:{node.lineno} {ast.unparse(node)} (defined in {', '.join(sorted(owners[node.attr]))})")
    assert not bad, "use a public member or an interface instead: " + "; ".join(bad)


# Where the field checks themselves live: the only modules that may parse by hand.
WIRE_MODULES = ("potluck.core.wire", "potluck.net.wire")
# Methods that encode or decode a message: generated from a declaration, never written.
WIRE_METHODS = ("to_wire", "from_wire", "to_value", "from_value")
# The field checks that read a message's map key by key: hand-written parsing.
MAP_READERS = ("wire_map", "int_field", "number_field", "bool_field", "text_field", "bytes_field", "list_field")


def test_every_wire_message_is_declared_once():
    """Messages are `potluck.core.wire.Message` declarations: encoding, decoding and checks come
    from the fields, so no module writes its own `to_wire`/`from_wire` (or `to_value`/`from_value`)
    method, nor reads a message's map key by key with the field checks (`wire_map`, `int_field`,
    ...), outside the field checks themselves. (A field type of a package may check a value with
    `int_value` and the like: that is declaring a field, not parsing a message.)"""
    hand_written = []
    for name, tree in trees().items():
        if name in WIRE_MODULES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in WIRE_METHODS:
                        hand_written.append(f"{name}.{node.name}.{item.name}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in MAP_READERS:
                hand_written.append(f"{name}:{node.lineno} {node.func.id}(...)")
    assert not hand_written, ("declare these as potluck.core.wire.Message classes (with a field type of your "
                              "package for what no field declares): " + ", ".join(hand_written))
