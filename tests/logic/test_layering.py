"""The layout's rules, checked on the source: who may import whom, no circles, a router whose
domain logic loads neither Ray nor vLLM, and nothing that points outside the repository."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("pdserve_proto", "pdserve_core", "prefill_node", "decode_node", "router", "pdserve")
HEAVY = ("vllm", "ray", "torch", "transformers", "grpc")

LAYERS = (
    ("generated", {"pdserve_proto"}),
    (
        "ground",
        {
            "pdserve_core",
            "pdserve_core.model_prep",
            "pdserve_core.tls",
            "pdserve_core.kv",
            "pdserve_core.roofline",
            "pdserve_core.config",
            "pdserve_core.engine",
        },
    ),
    ("roles", {"prefill_node", "decode_node"}),
    ("router", {"router"}),
    ("tools", {"pdserve.planner", "pdserve.bench", "pdserve.sim", "pdserve.hosts"}),
    (
        "application",
        {
            "pdserve",
            "pdserve.flex",
            "pdserve.nodes",
            "pdserve.routers",
            "pdserve.serve",
            "pdserve.cli",
        },
    ),
)
"""The folders, bottom to top: what everything stands on (pdserve_core/), the roles
(prefill_node/, decode_node/), the router (router/), the tools that size, measure and try a
deployment (pdserve/planner, bench, sim, hosts: the simulator runs the router's own code), and
the application (pdserve/: serving, placing nodes, the command line). A folder imports only
folders of its own layer or below."""

ALLOWED = {
    "pdserve_proto": set(),
    "pdserve_core": set(),
    "pdserve_core.roofline": {"pdserve_core.model_prep"},
    "pdserve_core.model_prep": set(),
    "pdserve_core.tls": set(),
    "pdserve_core.kv": {"pdserve_proto", "pdserve_core.tls"},
    "pdserve_core.config": {"pdserve_core.kv", "pdserve_core.roofline", "pdserve_core.tls"},
    "pdserve_core.engine": {
        "pdserve_core.config",
        "pdserve_core.kv",
        "pdserve_core.roofline",
        "pdserve_core.tls",
        "pdserve_proto",
    },
    "prefill_node": {
        "pdserve_core.config",
        "pdserve_core.engine",
        "pdserve_core.kv",
        "pdserve_proto",
    },
    "decode_node": {
        "pdserve_core.config",
        "pdserve_core.engine",
        "pdserve_core.kv",
        "pdserve_proto",
    },
    "router": {
        "pdserve_core.config",
        "pdserve_core.engine",
        "pdserve_core.kv",
        "pdserve_core.tls",
        "pdserve_proto",
    },
    "pdserve.planner": {"pdserve_core.roofline"},
    "pdserve.bench": {
        "pdserve_core.model_prep",
        "pdserve_core.config",
        "pdserve_core.engine",
        "pdserve.planner",
        "pdserve_core.roofline",
    },
    "pdserve.sim": {
        "pdserve.bench",
        "pdserve_core.config",
        "pdserve_core.engine",
        "pdserve_core.model_prep",
        "pdserve_core.roofline",
        "router",
    },
    "pdserve.hosts": set(),
    "pdserve": set(),
    "pdserve.flex": {"prefill_node", "decode_node"},
    "pdserve.nodes": {
        "pdserve_core.config",
        "pdserve_core.engine",
        "pdserve_core.kv",
        "prefill_node",
        "decode_node",
        "pdserve.flex",
        "router",
    },
    "pdserve.routers": {"pdserve_core.config", "router"},
    "pdserve.serve": {
        "pdserve",
        "pdserve.nodes",
        "pdserve.routers",
        "pdserve_core.config",
        "pdserve_core.engine",
        "pdserve_core.model_prep",
        "pdserve_core.roofline",
        "prefill_node",
        "decode_node",
        "router",
    },
    "pdserve.cli": {
        "pdserve",
        "pdserve.hosts",
        "pdserve.bench",
        "pdserve_core.config",
        "pdserve_core.model_prep",
        "pdserve.planner",
        "pdserve_core.roofline",
        "pdserve.serve",
        "pdserve.sim",
    },
}
"""Folder -> the folders it may import (a new edge must be added here, on purpose)."""

RUNTIME = {name for layer, names in LAYERS[:4] for name in names} | {
    "pdserve.flex",
    "pdserve.nodes",
    "pdserve.routers",
    "pdserve.serve",
}
"""What serves: the roles, the router and the ground they share (the cost model included: engines
price their steps with it)."""
TOOLS = LAYERS[4][1]
"""What sizes, measures and tries a deployment; built on the runtime, never under it."""

OUTSIDE_MARKERS = ("../" + "shared", "DESIGN" + ".md")
"""What a reference to the briefs outside the repository looks like (spelled in pieces, so a
plain search of the tree finds no such reference in this file either)."""

ROUTER_OUTSIDE = ("faces", "links")
"""router/'s folders that face out, to the clients (HTTP, gRPC, vLLM's front end) and to the nodes
(Ray, the token streams): the only ones that may load a heavy package."""


def group(module: str) -> str:
    """The folder a module counts in: pdserve_core's and pdserve's parts one by one, every
    other package whole."""
    parts = module.split(".")
    split = parts[0] in ("pdserve", "pdserve_core") and len(parts) > 1
    return ".".join(parts[:2]) if split else parts[0]


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


def layer(folder: str) -> int:
    return next(i for i, (_, names) in enumerate(LAYERS) if folder in names)


def test_every_folder_imports_only_its_own_layer_or_below():
    assert set(ALLOWED) == {name for _, names in LAYERS for name in names}, "place every folder"
    up = sorted(
        f"{source} ({LAYERS[layer(source)][0]}) -> {target} ({LAYERS[layer(target)][0]})"
        for source, targets in package_graph().items()
        for target in targets
        if layer(target) > layer(source)
    )
    assert not up, f"edges back up: {up}"


def test_every_folder_on_disk_is_placed():
    on_disk = {group(module) for _, module in source_files() if module not in ("pdserve.__main__",)}
    placed = {name for _, names in LAYERS for name in names}
    assert on_disk <= placed, f"folders in no layer: {sorted(on_disk - placed)}"


def test_the_runtime_never_imports_a_tool():
    assert set(ALLOWED) <= RUNTIME | TOOLS | {"pdserve", "pdserve.cli"}, "classify every package"
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
    assert not graph["pdserve_core.kv"] & {"prefill_node", "decode_node", "router"}


def test_router_domain_logic_imports_no_heavy_package():
    for path in sorted((REPO / "router").rglob("*.py")):
        if path.relative_to(REPO / "router").parts[0] in ROUTER_OUTSIDE:
            continue
        heavy = {name for name in imports(path) if name.split(".")[0] in HEAVY}
        assert not heavy, f"{path.relative_to(REPO)} imports {sorted(heavy)}"


def test_importing_the_router_loads_neither_ray_nor_vllm():
    code = (
        "import sys\n"
        "import router.service, router.dispatch, router.pools, router.membership, router.build\n"
        "import router.decides.retry, router.metrics\n"
        "import router.faces.openai_http, router.faces.grpc_api\n"
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
