"""The layout's rules, checked on the source: who may import whom, no circles, a router whose
domain logic loads neither Ray nor vLLM, and nothing that points outside the repository."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("pdserve", "router", "prefill_node", "decode_node", "flex_node", "pdserve_proto")
HEAVY = ("vllm", "ray", "torch", "transformers", "grpc")

ALLOWED = {
    "pdserve_proto": set(),
    "pdserve.roofline": {"pdserve.model_prep"},
    "pdserve.model_prep": set(),
    "pdserve.tls": set(),
    "pdserve.kv": {"pdserve_proto", "pdserve.tls"},
    "pdserve.config": {"pdserve.kv", "pdserve.roofline", "pdserve.tls"},
    "pdserve.engine": {
        "pdserve.config",
        "pdserve.kv",
        "pdserve.roofline",
        "pdserve.tls",
        "pdserve_proto",
    },
    "prefill_node": {"pdserve.config", "pdserve.engine", "pdserve.kv", "pdserve_proto"},
    "decode_node": {"pdserve.config", "pdserve.engine", "pdserve.kv", "pdserve_proto"},
    "router": {"pdserve.engine", "pdserve.kv", "pdserve.tls", "pdserve_proto"},
    "pdserve.planner": {"pdserve.roofline"},
    "pdserve.bench": {
        "pdserve.model_prep",
        "pdserve.config",
        "pdserve.engine",
        "pdserve.planner",
        "pdserve.roofline",
    },
    "pdserve.sim": {
        "pdserve.bench",
        "pdserve.config",
        "pdserve.engine",
        "pdserve.roofline",
        "router",
    },
    "flex_node": {"pdserve.engine", "prefill_node", "decode_node"},
    "pdserve.nodes": {
        "pdserve.config",
        "pdserve.engine",
        "pdserve.kv",
        "prefill_node",
        "decode_node",
        "flex_node",
        "router",
    },
    "pdserve.serve": {
        "pdserve.nodes",
        "pdserve.config",
        "pdserve.engine",
        "pdserve.model_prep",
        "pdserve.roofline",
        "prefill_node",
        "decode_node",
        "router",
    },
    "pdserve.hosts": set(),
    "pdserve.cli": {
        "pdserve",
        "pdserve.hosts",
        "pdserve.bench",
        "pdserve.config",
        "pdserve.model_prep",
        "pdserve.planner",
        "pdserve.roofline",
        "pdserve.serve",
        "pdserve.sim",
    },
}
"""Package -> the packages it may import (a new edge must be added here, on purpose)."""

RUNTIME = {
    "pdserve_proto",
    "pdserve.model_prep",
    "pdserve.tls",
    "pdserve.kv",
    "pdserve.config",
    "pdserve.roofline",
    "pdserve.engine",
    "prefill_node",
    "decode_node",
    "flex_node",
    "router",
    "pdserve.nodes",
    "pdserve.serve",
}
"""What serves: the roles, the router and the ground they share (the cost model included: engines
price their steps with it)."""
TOOLS = {"pdserve.planner", "pdserve.bench", "pdserve.sim", "pdserve.hosts"}
"""What sizes, measures and tries a deployment; built on the runtime, never under it."""

OUTSIDE_MARKERS = ("../" + "shared", "DESIGN" + ".md")
"""What a reference to the briefs outside the repository looks like (spelled in pieces, so a
plain search of the tree finds no such reference in this file either)."""

ROUTER_EDGES = {
    "openai_http.py",
    "grpc_api.py",
    "ray_nodes.py",
    "vllm_face.py",
}
"""Router modules that talk to the outside (HTTP, gRPC, vLLM's request classes, Ray)."""


def group(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pdserve" and len(parts) > 1 else parts[0]


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def source_files():
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            yield path, module.removesuffix(".__init__")


def package_graph() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for path, module in source_files():
        for imported in imports(path):
            if imported.split(".")[0] in PACKAGES and group(imported) != group(module):
                graph[group(module)].add(group(imported))
    return graph


def test_every_import_between_packages_is_an_allowed_edge():
    unexpected = {
        (source, target)
        for source, targets in package_graph().items()
        for target in targets
        if target not in ALLOWED.get(source, set())
    }
    assert not unexpected, f"imports not in ALLOWED: {sorted(unexpected)}"


def test_the_runtime_never_imports_a_tool():
    assert set(ALLOWED) <= RUNTIME | TOOLS | {"pdserve.cli"}, "classify every package"
    graph = package_graph()
    upward = {(source, target) for source in RUNTIME for target in graph[source] & TOOLS}
    assert not upward, f"the runtime imports tools: {sorted(upward)}"


def test_the_package_graph_has_no_circles():
    graph = package_graph()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in graph.get(node, ()):
            assert state.get(target) != "open", f"import circle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in list(graph):
        if node not in state:
            visit(node, [node])


def test_the_roles_never_import_each_other_and_the_shared_kv_imports_neither():
    graph = package_graph()
    assert "decode_node" not in graph["prefill_node"]
    assert "prefill_node" not in graph["decode_node"]
    assert not graph["pdserve.kv"] & {"prefill_node", "decode_node", "router"}


def test_router_domain_logic_imports_no_heavy_package():
    for path in sorted((REPO / "router").rglob("*.py")):
        if path.name in ROUTER_EDGES:
            continue
        heavy = {name for name in imports(path) if name.split(".")[0] in HEAVY}
        assert not heavy, f"{path.relative_to(REPO)} imports {sorted(heavy)}"


def test_importing_the_router_loads_neither_ray_nor_vllm():
    code = (
        "import sys\n"
        "import router.service, router.dispatch, router.pools, router.retry, router.metrics\n"
        "import router.openai_http, router.grpc_api\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY) - {'grpc'}!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    outside = []
    for name in tracked:
        path = REPO / name
        if (
            path.suffix not in (".py", ".md", ".yml", ".yaml", ".sh", ".toml")
            and name != "Makefile"
        ):
            continue
        text = path.read_text(errors="replace")
        if any(marker in text for marker in OUTSIDE_MARKERS):
            outside.append(name)
    assert not outside, f"these files point outside the repository: {outside}"
