"""Grammar bombs and runaway whitespace, without a model: the size limits refuse each
bomb class before xgrammar sees it (naming the field and the setting), the compile
deadline fails a request whose compile hangs without holding up other compiles, and
constrained JSON refuses a long run of whitespace unless the setting says unbounded."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import xgrammar as xgr

from pagedserve.config import StructuredOutputsConfig
from pagedserve.structured_output import StructuredOutputManager, StructuredOutputsParams, build_grammar
from pagedserve.structured_output.limits import GrammarLimits, check_limits, repetition_product

pytestmark = pytest.mark.timeout(120)

LIMITS = GrammarLimits()


def _tree(depth: int) -> dict:
    if depth == 0:
        return {"type": "string"}
    return {"type": "object", "properties": {"a": _tree(depth - 1), "b": _tree(depth - 1)}}


def _rules(n: int) -> str:
    return "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "b"\nroot ::= r0'


# The bombs of the report, each with the setting that must refuse it.
BOMBS = {
    "16k-leaf schema": (StructuredOutputsParams(json=_tree(14)), "max_grammar_bytes"),
    "200,000-string enum": (StructuredOutputsParams(json={"enum": [f"s{i}" for i in range(200_000)]}), "max_grammar"),
    "(x{1000}){1000}": (StructuredOutputsParams(regex="(x{1000}){1000}"), "max_grammar_repetition"),
    "minItems 10,000,000": (
        StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "minItems": 10_000_000}),
        "max_grammar_repetition",
    ),
    "20,000 rules": (StructuredOutputsParams(grammar=_rules(20_000)), "max_grammar"),
    "nested pattern": (
        StructuredOutputsParams(json={"type": "string", "pattern": "^([a-z]{1,1000}){1,1000}$"}),
        "max_grammar_repetition",
    ),
    "small enum, many values": (StructuredOutputsParams(json={"enum": list(range(5000))}), "max_grammar_items"),
    "many choices": (StructuredOutputsParams(choice=[str(i) for i in range(5000)]), "max_grammar_items"),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_each_bomb_class_is_refused_before_compiling(name):
    params, setting = BOMBS[name]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"structured_outputs\.{params.kind}.*{setting}") as info:
        build_grammar(params, LIMITS)
    assert "--" + setting.split("=")[0].replace("_", "-") in str(info.value)
    assert time.monotonic() - t0 < 30  # a deadline, not a speed claim: today these build for minutes


def test_minitems_error_names_the_keyword_and_where():
    schema = {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 5000}}}
    with pytest.raises(ValueError, match=r"maxItems at /properties/xs 5000 exceeds max_grammar_repetition=1000"):
        check_limits(StructuredOutputsParams(json=schema), LIMITS)


def test_ordinary_constraints_pass_and_limits_are_settings():
    for params in (
        StructuredOutputsParams(json=_tree(5)),
        StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
        StructuredOutputsParams(json={"type": "array", "maxItems": 1000}),
        StructuredOutputsParams(grammar='root ::= "a"{2,8}'),
    ):
        check_limits(params, LIMITS)
    check_limits(BOMBS["(x{1000}){1000}"][0], GrammarLimits(max_repetition=10**6))
    with pytest.raises(ValueError, match="max_grammar_repetition must be at least 1"):
        StructuredOutputsConfig(max_grammar_repetition=0)


@pytest.mark.parametrize(
    ("text", "quoted", "product"),
    [
        ("(x{1000}){1000}", False, 10**6),
        ("((a|aa)*b){1,500}", False, 500),
        (r"[{]{3}\{5}(a{2}){3}", False, 6),
        ("a{2,}b{4}", False, 4),
        ("(a{10}|b{20}){5}(c{7})", False, 100),
        ('root ::= "x{99}" [a]{3}', True, 3),
    ],
)
def test_repetition_product(text, quoted, product):
    assert repetition_product(text, quoted) == product


# -- compile deadline -------------------------------------------------------------------------
class _HangingBackend:
    """Compiles "slow" constraints only when released; others at once."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def compile(self, grammar):
        if "slow" in str(grammar):
            self.release.wait(60)
        return "compiled"

    @staticmethod
    def matcher(compiled):
        return compiled


@pytest.fixture
def manager():
    mgr = StructuredOutputManager("xgrammar", None, 64, [0], compile_timeout=0.5)
    backend = _HangingBackend()
    mgr._backend = backend  # skip reading a vocabulary: the deadline does not depend on it
    yield mgr
    backend.release.set()
    mgr.shutdown()


def _wait_ready(state, limit: float = 30.0) -> float:
    t0 = time.monotonic()
    while not state.ready():
        assert time.monotonic() - t0 < limit, "the grammar state never became ready"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_a_hanging_compile_fails_at_the_deadline_and_is_refused_after(manager, monkeypatch):
    monkeypatch.setattr("pagedserve.structured_output.manager.XgrammarBackend.matcher", _HangingBackend.matcher)
    slow = StructuredOutputsParams(choice=["slow"])
    state = manager.new_state(manager.prepare(slow))
    _wait_ready(state)
    assert state.failed is not None and "grammar_compile_timeout=0.5s" in state.failed
    # Another constraint compiles meanwhile: the hanging one holds one worker, not all.
    other = manager.new_state(manager.prepare(StructuredOutputsParams(choice=["quick"])))
    _wait_ready(other, limit=5)
    assert other.failed is None and other.matcher == "compiled"
    with pytest.raises(ValueError, match=r"structured_outputs\.choice: .*grammar_compile_timeout"):
        manager.prepare(slow)


def test_no_deadline_with_timeout_zero(manager):
    manager.compile_timeout = 0
    state = manager.new_state(manager.prepare(StructuredOutputsParams(choice=["slow"])))
    time.sleep(0.8)
    assert not state.ready()


def test_grammar_failure_fails_the_request():
    from pagedserve.structured_output.engine_hooks import check_grammar_failed
    from pagedserve.structured_output.manager import GrammarState

    state = GrammarState(Future())
    state.failed = "structured_outputs: the constraint did not compile within grammar_compile_timeout=1s"

    class _Req:
        structured = state

    with pytest.raises(ValueError, match="grammar_compile_timeout"):
        check_grammar_failed(_Req())


# -- bounded whitespace -----------------------------------------------------------------------
def _matcher(grammar) -> xgr.GrammarMatcher:
    # A character-level vocabulary: every accepted string is spelled out token by token.
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "\t", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_grammar(grammar))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_json_refuses_a_run_of_25_newlines_by_default(kind):
    params = StructuredOutputsParams(json=SCHEMA) if kind == "json" else StructuredOutputsParams(json_object=True)
    m = _matcher(build_grammar(params, LIMITS))
    assert m.accept_string("{")
    assert not all(m.accept_string("\n") for _ in range(25))
    m = _matcher(build_grammar(params, LIMITS))
    assert m.accept_string("{" + "\n" * 20 + '"a": 1}')  # 20 is within the default bound


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_unbounded_whitespace_setting(kind):
    params = StructuredOutputsParams(json=SCHEMA) if kind == "json" else StructuredOutputsParams(json_object=True)
    m = _matcher(build_grammar(params, LIMITS, max_whitespace=-1))
    assert m.accept_string("{" + "\n" * 200 + '"a": 1}')
    assert StructuredOutputsConfig().max_json_whitespace == 20


def test_data_keywords_are_not_walked_as_schemas():
    schema = {"type": "object", "default": {"minItems": 10**9}, "examples": [{"maxLength": 10**9}]}
    check_limits(StructuredOutputsParams(json=schema), LIMITS)
