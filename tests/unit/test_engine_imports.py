"""The engine side imports none of the agent daemon's modules (agent/engine/__init__.py).

Code under agent/engine/ runs inside vLLM's processes (or any engine's): it may
import itself, the shared pool format and bounds, and anything outside
kvdir.agent (kvdir.core, kvdir.transfer, kvdir.v1), never the daemon. Read
from the source with `ast`, so a lazy import inside a function counts too,
and followed through the shared modules, so a shared module that starts
importing the daemon fails here as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"
ENGINE = AGENT / "engine"
SHARED = {"pool", "pool_file", "owners", "gpu_pool", "limits"}
"""kvdir.agent modules both sides use: the pool format, GPU tier slots, bounds."""


def _agent_imports(path: Path) -> set[str]:
    """kvdir.agent.* modules `path` imports (as dotted names under kvdir.agent)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("kvdir.agent."):
                out.add(name.removeprefix("kvdir.agent."))
    return out


def _module_file(name: str) -> Path | None:
    base = AGENT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _allowed(name: str) -> bool:
    top = name.split(".", maxsplit=1)[0]
    return top == "engine" or top in SHARED or top == "vllm"


def test_the_engine_side_imports_no_daemon_module() -> None:
    files = sorted(ENGINE.rglob("*.py")) + sorted((AGENT / "vllm").rglob("*.py"))
    assert files, "agent/engine/ has no modules"
    seen: set[Path] = set()
    todo = [(f, f.relative_to(AGENT).as_posix()) for f in files]
    bad: list[str] = []
    while todo:
        path, via = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in sorted(_agent_imports(path)):
            target = _module_file(name)
            if target is None:
                continue  # `from kvdir.agent.pool import X`: X is a name, not a module
            if not _allowed(name):
                bad.append(f"{via} imports kvdir.agent.{name}")
            elif not target.is_relative_to(ENGINE):
                todo.append((target, f"{via} -> {name}"))
    assert not bad, "the engine side imports the daemon:\n" + "\n".join(bad)


def test_the_check_sees_a_daemon_import(tmp_path: Path) -> None:
    """The walker finds both import forms (so the test above can fail)."""
    f = tmp_path / "m.py"
    f.write_text(
        "from kvdir.agent.service import AgentCore\ndef later():\n    import kvdir.agent.fetcher\n"
    )
    got = _agent_imports(f)
    assert {"service", "fetcher"} <= got
    assert not _allowed("service") and not _allowed("fetcher") and _allowed("pool")
