"""The package's shape: layers import only downward, no module imports itself back through others, and a
recovery signal's name picks its class in one place.

Read from the source (every import a module can run, at its top or inside a function; those under
``if TYPE_CHECKING:`` excepted: annotations only), not from what happens to be imported at run time."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvos"

# module prefix -> layer; the longest matching prefix decides. A module imports only its own layer or lower.
LAYERS = {
    "kvos": 0,  # the package itself: a version string
    "kvos.errors": 0,
    "kvos.extensions": 0,
    "kvos.flock": 0,
    "kvos.builtin": 0,  # the package's __init__: where the built-in model lives, no imports
    "kvos.memory": 1,
    "kvos.model": 2,
    "kvos.engine": 3,
    "kvos.policy": 4,
    "kvos.session": 5,
    "kvos.builtin.": 6,  # the built-in model's corpus, training, evaluation and session playback
    "kvos.server": 7,
    "kvos.bench": 8,
    "kvos.cli": 9,
    "kvos.__main__": 9,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(name: str, path: Path) -> set[str]:
    """The kvos modules ``name`` (at ``path``) imports: ``from pkg import sub`` counts as the submodule."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def layer(name: str) -> int:
    best = max(
        (p for p in LAYERS if name == p or name.startswith(p if p.endswith(".") else p + ".")), key=len
    )
    return LAYERS[best]


def test_the_graph_is_read() -> None:
    """The reader finds what it must (else every other test here passes vacuously)."""
    assert len(MODULES) > 100
    assert "kvos.session.memory" in GRAPH["kvos.session.session"]
    assert "kvos.memory.container" in GRAPH["kvos.memory.store"]  # `from kvos.memory import container`
    assert "kvos.session.memory" not in GRAPH["kvos.session.recovery.base"]  # under TYPE_CHECKING only
    assert layer("kvos.builtin") == 0 and layer("kvos.builtin.playback") == 6 and layer("kvos.cli.demo") == 9


def test_layers_import_only_downward() -> None:
    upward = sorted(
        f"{name} (layer {layer(name)}) imports {dep} (layer {layer(dep)})"
        for name, deps in GRAPH.items()
        for dep in deps
        if layer(dep) > layer(name)
    )
    assert not upward, "\n".join(upward)


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over the module graph: every one a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                connect(w)
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
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            connect(v)
    assert not cycles, cycles


def test_no_product_module_imports_the_benchmarks() -> None:
    """Only the benchmarks themselves and the command line (``kvos bench``) import ``kvos.bench``."""
    bad = sorted(
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        for dep in deps
        if dep.startswith("kvos.bench") and not name.startswith(("kvos.bench", "kvos.cli"))
    )
    assert not bad, "\n".join(bad)


def test_a_requests_work_runs_one_way_alone_and_under_the_scheduler() -> None:
    """No module asks which mode it runs in: the engine hands every forward pass to the runner of its
    context (:mod:`kvos.engine.passes`) and knows nothing of the scheduler, which installs itself there."""
    asking = sorted(name for name, path in MODULES.items() if "holds_turn" in path.read_text())
    assert not asking, asking
    assert "kvos.engine.scheduler" not in GRAPH["kvos.engine.engine"] | GRAPH["kvos.engine.passes"]
    tree = ast.parse(MODULES["kvos.engine.engine"].read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not {"scheduler", "Scheduler"} & names


def test_no_branch_on_a_recovery_signals_name() -> None:
    """A signal's name picks its class in :mod:`kvos.session.recovery.factory`; elsewhere code asks the class
    (its attributes and methods), never compares the name ("auto", a choice of names, aside)."""
    from kvos.session.recovery import SIGNALS

    names = set(SIGNALS) - {"auto"}
    branches = []
    outside = (p for n, p in MODULES.items() if not n.startswith("kvos.session.recovery"))
    compares = (
        (path, node)
        for path in outside
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
    )
    for path, node in compares:
        sides = [node.left, *node.comparators]
        literals = {
            c.value
            for side in sides
            for c in ast.walk(side)
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        }
        if literals & names and any("signal" in ast.unparse(side) for side in sides):
            branches.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not branches, "\n".join(branches)


def test_the_server_reads_sessions_through_their_narrow_methods() -> None:
    """The server asks a session (its stats, history length, event counts, swap) and touches nothing deeper:
    no ``.memory``, ``.pager``, ``.history``, ``.writer`` or ``.chunks`` of anything."""
    inner = {"memory", "pager", "history", "writer", "chunks"}
    reaches = sorted(
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
        for name, path in MODULES.items()
        if name.startswith("kvos.server")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in inner
    )
    assert not reaches, "\n".join(reaches)


def _assigned(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment writes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, ast.Tuple | ast.List):
            targets.extend(t.elts)
        else:
            flat.append(t)
    return flat


def _attribute_writes(attrs: set[str], allowed: set[str]) -> list[str]:
    """Assignments to ``x.<attr>`` outside the ``allowed`` modules (an object's own ``self.<attr>`` aside)."""
    return sorted(
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
        for name, path in MODULES.items()
        if name not in allowed
        for node in ast.walk(ast.parse(path.read_text()))
        for target in _assigned(node)
        if isinstance(target, ast.Attribute)
        and target.attr in attrs
        and not (isinstance(target.value, ast.Name) and target.value.id == "self")
    )


def test_only_the_pager_records_where_a_chunks_kv_are() -> None:
    """A chunk's residency (its state: in the pool, saved, or breadcrumb only; its cache position) is not
    stored on the chunk: :class:`Chunk` reads both from its placement, and only the session's
    :class:`~kvos.session.pager.Pager` makes itself a chunk's placement. Nothing assigns them."""
    from kvos.policy.chunks import Chunk

    assert not {"state", "current_start"} & {f.name for f in dataclasses.fields(Chunk)}
    assert isinstance(Chunk.state, property) and isinstance(Chunk.current_start, property)
    assert not _attribute_writes({"state", "current_start"}, set())
    assert not _attribute_writes({"placement"}, {"kvos.session.pager"})


def _calls(name: str, receiver: str = "") -> dict[str, list[str]]:
    """Module -> the calls (as written) of a function or method called ``name`` (a method only on an
    object whose expression ends with ``receiver``, when given)."""
    found: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                on = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
                if called == name and on.endswith(receiver):
                    found.setdefault(module, []).append(
                        f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}"
                    )
    return found


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("select_victims", {"kvos.policy.planner"}),  # which chunks go: the planner's plans alone
        ("pressure_victim", {"kvos.policy.planner"}),  # pool_victim's parts
        ("cheapest_elsewhere", {"kvos.policy.planner"}),
        ("plan_room", {"kvos.session.memory"}),  # a plan is carried out by the executor...
        ("pool_victim", {"kvos.session.arbiter"}),  # ...the pool's, at its cap...
        ("plan_swaps", {"kvos.server.registry"}),  # ...or, for whole sessions, by the registry
        ("stale_branches", {"kvos.server.registry"}),
        ("plan_truncate", {"kvos.session.session"}),  # ...or, for a cut history, by the session
        ("pager.evict", {"kvos.session.memory"}),  # the pager pages out what a plan names
        ("pager.discard", {"kvos.session.session"}),
        ("admissible", {"kvos.engine.scheduler"}),  # which waiting requests start: the scheduler's plan
        ("ram_leavers", {"kvos.memory.store"}),  # a store's tiers: its plans, carried out by the store
        ("disk_leavers", {"kvos.memory.store"}),
    ],
)
def test_victims_are_picked_by_the_planner_and_paged_out_by_its_executors(
    name: str, allowed: set[str]
) -> None:
    """Eviction decisions are made in :mod:`kvos.policy.planner` (and, for a chunk store's tiers,
    :mod:`kvos.memory.tier_plan`) only: their functions are called by the executors that carry their plans
    out, and the pager's ``evict`` and ``discard`` only by the session's executors (and the pager itself,
    swapping a whole session out)."""
    method, _, receiver = name.rpartition(".")[::-1]
    calls = _calls(method, receiver)
    assert calls, f"no call of {name} found: the check reads nothing"
    outside = {m: c for m, c in calls.items() if m not in allowed}
    assert not outside, outside


def _callers(module: str, name: str) -> set[str]:
    """The functions of ``module`` that call a method or function called ``name``."""
    found = set()
    for fn in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                func = node.func if isinstance(node, ast.Call) else None
                if getattr(func, "attr", getattr(func, "id", None)) == name:
                    found.add(fn.name)
    return found


def test_a_store_moves_entries_between_tiers_only_as_its_plans_say() -> None:
    """The chunk store spills an entry out of RAM, and drops one, only in carrying out its tier plans
    (and, for a drop, when a spill cannot be written or a file is found corrupt): no choice of keys of its
    own."""
    assert _callers("kvos.memory.store", "_spill") == {"_keep_within_caps"}
    assert _callers("kvos.memory.store", "_drop") == {"_keep_within_caps", "_spill", "_read"}
    assert _callers("kvos.memory.store", "ram_leavers") == {"_keep_within_caps"}
