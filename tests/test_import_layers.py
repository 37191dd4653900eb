"""The package's layers: the HTTP-only pieces import neither torch nor the engine, and tokenmill's
subpackages import each other without cycles at module level."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenmill"
HEAVY = ("torch", "tokenmill.engine")

# what a client of the router, the disaggregation proxy or a remote benchmark imports
LIGHT_IMPORTS = [
    "import tokenmill",
    "import tokenmill.router",
    "from tokenmill.router.app import build_router_app",
    "import tokenmill.router.cli",
    "import tokenmill.kv_transfer.proxy",
    "import tokenmill.kv_transfer.cli",
    "import tokenmill.bench.client",
    "import tokenmill.bench.cli",
    "import tokenmill.engine_args",
    # the command line's parser for the commands that never run the engine here
    "from tokenmill.entrypoints.cli import build_parser; build_parser('router'); build_parser('disagg-proxy')",
    "from tokenmill.entrypoints.cli import build_parser; build_parser('bench').parse_args(['bench', 'serve'])",
]


def test_http_only_pieces_do_not_import_torch_or_the_engine():
    """Every statement in turn in one fresh interpreter (an interpreter each would cost a start apiece),
    each followed by a line naming what of HEAVY is loaded: the first such line that names one shows the
    statement at fault (those before it loaded none)."""
    check = "import sys\n" + "".join(
        f"{statement}; print(','.join(m for m in {HEAVY!r} if m in sys.modules), flush=True)\n"
        for statement in LIGHT_IMPORTS
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split("\n")[: len(LIGHT_IMPORTS)]
    assert len(loaded) == len(LIGHT_IMPORTS), result.stdout
    for statement, heavy in zip(LIGHT_IMPORTS, loaded):
        assert heavy == "", f"`{statement}` imports {heavy}"


def test_the_package_still_offers_llm_and_sampling_params_on_first_use():
    check = (
        "import sys, tokenmill; assert 'torch' not in sys.modules; "
        "from tokenmill import LLM, SamplingParams; "
        "from tokenmill.entrypoints.llm import LLM as L; assert LLM is L and 'LLM' in dir(tokenmill); "
        "print(SamplingParams(max_tokens=3).max_tokens)"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"


# Package-level edges that close cycles today, each with who removes it. Remove an entry once its edge is
# gone; the test then keeps it gone.
KNOWN_CYCLE_EDGES = {
    # the plain data of the step contract (SchedulerOutput, ModelRunnerOutput, Request) lives in engine/,
    # above the executor and the runner that use it; moving it below them removes these
    ("executor", "engine"),
    ("worker", "engine"),
    # config.py checks architecture names with models/registry.py, whose model files import config.py
    ("config", "models"),
}


def _node(module: str) -> str:
    """The graph node of a `tokenmill.*` module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_level_imports(tree: ast.Module):
    """Modules imported when the module runs: not inside functions, not under `if TYPE_CHECKING:`."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "tokenmill uses absolute imports"
            if node.module == "tokenmill":  # `from tokenmill import engine`
                yield from (f"tokenmill.{alias.name}" for alias in node.names)
            elif node.module:
                yield node.module
        else:
            stack.extend(ast.iter_child_nodes(node))


def package_graph() -> dict[str, dict[str, str]]:
    """node -> {node it imports: one file that does}, over tokenmill's subpackages and top-level modules."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        source = _node(".".join(parts))
        if source == "__init__":  # tokenmill/__init__.py
            continue
        for name in _module_level_imports(ast.parse(path.read_text(), str(path))):
            target = _node(name) if name.startswith("tokenmill.") else None
            if target and target != source:
                graph.setdefault(source, {}).setdefault(target, str(path.relative_to(ROOT)))
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """A cycle of nodes (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}}) is None


def test_no_import_cycles_between_subpackages():
    graph = package_graph()
    assert graph["server"]["engine"]  # the walk sees real edges
    pruned = {
        src: {dst: f for dst, f in targets.items() if (src, dst) not in KNOWN_CYCLE_EDGES}
        for src, targets in graph.items()
    }
    cycle = find_cycle(pruned)
    assert cycle is None, (
        "import cycle between packages: "
        + " -> ".join(f"{a} ({pruned[a][b]})" for a, b in zip(cycle, cycle[1:]))
        + f" -> {cycle[-1]}"
    )
