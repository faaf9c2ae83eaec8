"""No module assigns the attributes of another object: a component changes its own state,
and others ask it to by its constructor or its methods.

Parsed with ``ast`` over core/ (the ``pagedserve`` package).  An assignment target
``x.attr`` is foreign when

- it reaches through an attribute (``a.b.c = v``, ``self.runner.structured = v``): the
  object assigned to belongs to someone else; or
- ``x`` is a parameter of the enclosing function (other than ``self``/``cls``) whose
  annotation is not a record: a ``@dataclass`` defined in pagedserve (plain data that is
  passed along to be filled in, like `Request` or `KVBlock`).

Objects a function creates itself and then fills in (``out = Output(); out.x = ...``)
are construction, not foreign.  The allow-list below names each remaining exception
with its reason; keep it short.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"

#: (path under core/, assignment target as ast.unparse writes it; fnmatch patterns) -> why
#: it is allowed.
ALLOWED = {
    # The free-block queue is an intrusive doubly linked list of its own KVBlock records.
    ("kv_cache/block_pool.py", "self.tail.next"): "the free queue's own linked list",
    ("kv_cache/block_pool.py", "block.prev.next"): "the free queue's own linked list",
    ("kv_cache/block_pool.py", "block.next.prev"): "the free queue's own linked list",
    # Owners updating their own private records through a second name.
    ("lora/manager.py", "self.state.token_slots"): "the manager's own step state, read by its layers",
    ("serving/router.py", "r.*"): "the router's own per-replica records (_Replica)",
    ("serving/router.py", "inflight.replica.*"): "the router's own per-replica records (_Replica)",
    # Third-party objects whose documented way of configuration is assignment.
    ("entrypoints/openai/api_server.py", "app.state.drain"): "Starlette's app.state is the app's own namespace",
    ("entrypoints/openai/openapi.py", "app.openapi_schema"): "FastAPI's documented OpenAPI override",
    ("entrypoints/openai/openapi.py", "app.openapi"): "FastAPI's documented OpenAPI override",
    ("loader/gguf_tokenizer.py", "backend.post_processor"): "tokenizers' documented post-processor setter",
    # Model definitions fill the layer objects the loader created for them (finish_layer).
    ("models/*.py", "layer.*"): "a model's finish_layer fills the layer built for it",
}


def _dataclass_names() -> set[str]:
    names = set()
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    if isinstance(target, ast.Name) and target.id == "dataclass":
                        names.add(node.name)
    return names


def _targets(node: ast.AST):
    if isinstance(node, ast.Assign):
        stack = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        stack = [node.target]
    else:
        return
    while stack:
        t = stack.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            stack += t.elts
        elif isinstance(t, ast.Starred):
            stack.append(t.value)
        elif isinstance(t, ast.Attribute):
            yield t


def _annotation_names(annotation: ast.expr | None) -> set[str]:
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)
    }


def foreign_assignments(source: str, records: set[str]) -> list[tuple[int, str]]:
    """(line, target) of each foreign attribute assignment in ``source``."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = fn.args
        params = {a.arg: a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        params.pop("self", None), params.pop("cls", None)
        for node in ast.walk(fn):
            for t in _targets(node):
                base = t.value
                if isinstance(base, ast.Attribute):
                    found.append((node.lineno, ast.unparse(t)))
                elif isinstance(base, ast.Name) and base.id in params:
                    if not _annotation_names(params[base.id]) & records:
                        found.append((node.lineno, ast.unparse(t)))
    return sorted(set(found))


def _allowed_by(rel: str, target: str) -> tuple[str, str] | None:
    for key in ALLOWED:
        if fnmatch.fnmatchcase(rel, key[0]) and fnmatch.fnmatchcase(target, key[1]):
            return key
    return None


def test_no_module_assigns_another_objects_attributes():
    records = _dataclass_names()
    problems, used = [], set()
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).as_posix()
        for line, target in foreign_assignments(path.read_text(), records):
            key = _allowed_by(rel, target)
            if key is not None:
                used.add(key)
            else:
                problems.append(f"core/{rel}:{line}: {target} = ...")
    assert not problems, "attributes of other objects assigned (use a constructor argument or a method):\n" + "\n".join(
        problems
    )
    stale = set(ALLOWED) - used
    assert not stale, f"allow-list entries that no longer match anything (remove them): {sorted(stale)}"


def test_the_check_can_fail():
    planted = """
class Engine:
    def __init__(self, runner, scheduler):
        self.runner = runner
        self.runner.structured = 1          # through an attribute
        scheduler.max_loras = 2             # a parameter that is not a record

def fill(request: Request, other) -> None:
    request.status = 3                      # a record: allowed
    other.attr = 4                          # unannotated parameter

def build():
    out = Output()
    out.x = 5                               # construction: allowed
"""
    found = foreign_assignments(planted, {"Request"})
    assert [t for _, t in found] == ["self.runner.structured", "scheduler.max_loras", "other.attr"]
