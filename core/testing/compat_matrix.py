"""The feature x deployment compatibility matrix, derived rather than written down.

Rows are features, columns deployments (ids fixed by docs/compatibility.md).  A cell's
engine settings are the single-process base plus the feature's settings plus the
deployment's (:func:`cell_kwargs`); its state is computed:

- ``refused``: building that EngineConfig, or one of the model-shape checks of
  :mod:`pagedserve.config_rules` (on the tiny test model's shape), or a deployment's own
  rule (data-parallel replicas, disaggregated prefill/decode) raises ValueError.  The
  messages are the cell's refusals, exactly as a user meets them before weights load.
- ``works``: some test under ``tests/`` carries ``@pytest.mark.compat(feature,
  deployment)``, found by reading the test files (:func:`scan_tests`; no test runs).  A
  module may instead declare the literal tuples ``COMPAT_FEATURES`` and
  ``COMPAT_DEPLOYMENTS``: it proves every pair of them that is not refused (the
  parametrized equality suite of tests/compat/ does).
- ``untested``: neither.

A cell both refused and claimed by a test is a contradiction, reported by
:func:`matrix_problems` (and failed by tests/test_compatibility_doc.py).

    python -m pagedserve.testing.compat_matrix --write docs/compatibility.md
    python -m pagedserve.testing.compat_matrix --check docs/compatibility.md
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Feature",
    "Deployment",
    "FEATURES",
    "DEPLOYMENTS",
    "TINY_HF_CONFIG",
    "BASE_KWARGS",
    "Cell",
    "cell_kwargs",
    "cell_refusals",
    "scan_tests",
    "suite_cells",
    "build_matrix",
    "matrix_problems",
    "render",
    "NOTES",
    "main",
]

#: The shape of the tiny test model whose checks decide refusals (tests/conftest.py's
#: ``make_tiny_checkpoint`` with these sizes; tests/compat/ serves exactly this shape).
TINY_HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

#: The single-process engine every cell starts from (small, exact: float32).
BASE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "kv_cache_memory": "8MiB",
    "block_size": 4,
    "max_model_len": 64,
    "max_num_batched_tokens": 16,
}

_MODEL = "{model}"  # stands for the served model's path in a feature's settings


@dataclass(frozen=True)
class Feature:
    """A row.  ``kwargs``: the engine settings that turn it on (on the tiny test model;
    ``_MODEL`` stands for the model's own path); ``default_kwargs``: the settings on the
    default model where they differ.  ``request``: what a request sets to use it (a
    per-request feature has no settings).  ``windows``: the per-layer attention windows of
    the model the feature needs (None: the tiny model's, no windows).  ``disagg_request``:
    the key of ``config_rules.disaggregated_request_refusal`` that a disaggregated
    prefill/decode pair refuses such requests by."""

    id: str
    title: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    default_kwargs: Mapping[str, Any] | None = None
    request: str = ""
    windows: tuple[int | None, ...] | None = None
    disagg_request: str | None = None


@dataclass(frozen=True)
class Deployment:
    """A column: its engine settings, plus what runs beside the engine (data-parallel
    replicas behind a router, a disaggregated prefill instance)."""

    id: str
    title: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    data_parallel_size: int = 1
    disaggregated: bool = False


_SPEC = {"num_speculative_tokens": 3}

FEATURES: tuple[Feature, ...] = (
    Feature("prefix_caching", "prefix caching", {"enable_prefix_caching": True}),
    Feature("chunked_prefill", "chunked prefill", {"enable_chunked_prefill": True}),
    Feature(
        "preemption_recompute",
        "preemption by recompute",
        {"preemption_mode": "recompute", "num_gpu_blocks_override": 24},
    ),
    Feature(
        "preemption_swap",
        "preemption by swap",
        {"preemption_mode": "swap", "num_gpu_blocks_override": 24, "kv_offload_memory": "4MiB"},
    ),
    Feature("n_best_of", "n > 1 / best_of", request="SamplingParams(n=..., best_of=...)"),
    Feature("beam_search", "beam search", request="LLM.beam_search / use_beam_search"),
    Feature("structured_outputs", "structured outputs", request="structured_outputs / response_format"),
    Feature("logits_processors", "logits processors", request="logit_bias, allowed_token_ids, bad_words"),
    Feature("spec_ngram", "speculative: n-gram", {"speculative_config": {"method": "ngram", **_SPEC}}),
    Feature(
        "spec_draft_model",
        "speculative: draft model",
        {"speculative_config": {"method": "draft_model", "model": _MODEL, **_SPEC}},
    ),
    Feature(
        "spec_self_quantized",
        "speculative: self-quantized",
        {"speculative_config": {"method": "self_quantized", "quantization": "int8", **_SPEC}},
        default_kwargs={"speculative_config": {"method": "self_quantized", **_SPEC}},
    ),
    Feature("lora", "multi-LoRA", {"enable_lora": True, "max_lora_rank": 8}),
    Feature("quant_gguf", "GGUF kept quantized", {"quantization": "gguf"}),
    Feature("quant_int8", "int8 weights", {"quantization": "int8"}),
    Feature("quant_fp8", "fp8 weights", {"quantization": "fp8"}),
    Feature("quant_gptq_awq", "GPTQ / AWQ", {"quantization": "gptq"}),
    Feature(
        "kv_groups",
        "KV cache groups (sliding windows)",
        {"free_sliding_window_blocks": True},
        windows=(8, None),
    ),
    Feature("pooling", "embeddings / pooling", request="LLM.embed / /v1/embeddings", disagg_request="pooling"),
    Feature("prompt_logprobs", "prompt logprobs", request="SamplingParams(prompt_logprobs=...)"),
    Feature("priority", "priorities", {"scheduling_policy": "priority"}, request="priority= per request"),
    Feature("sleep_mode", "sleep mode", {"enable_sleep_mode": True}, request="LLM.sleep / POST /sleep"),
    # A small device pool, so that cached prefixes are evicted and loaded back from the store.
    Feature("kv_connector", "KV connector (host, disk)", {"kv_connector": "host", "num_gpu_blocks_override": 32}),
)

DEPLOYMENTS: tuple[Deployment, ...] = (
    Deployment("single", "one process"),
    Deployment("tp_mp", "TP=2 (mp)", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}),
    Deployment("tp_ray", "TP=2 (Ray)", {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}),
    Deployment("pp", "PP=2", {"pipeline_parallel_size": 2}),
    Deployment("tp_pp", "TP=2 x PP=2", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    Deployment("dp", "2 data-parallel replicas", data_parallel_size=2),
    # 300 kB: every layer of the tiny float32 model (about 148 kB each) streams.
    Deployment("cpu_offload", "cpu_offload_gb", {"cpu_offload_gb": 0.0003}),
    # A small device pool, so that cached blocks spill to the host tier and come back.
    Deployment("kv_offload", "host KV tier", {"kv_offload_memory": "4MiB", "num_gpu_blocks_override": 32}),
    Deployment("device_map", "device_map", {"device_map": "cpu:1,cpu"}),
    Deployment("disagg", "disaggregated prefill/decode", disaggregated=True),
    Deployment("plugin_ort", "ort plugin platform", {"device": "ort"}),
)

_FEATURE = {f.id: f for f in FEATURES}
_DEPLOYMENT = {d.id: d for d in DEPLOYMENTS}


def _fill(value: Any, model: str) -> Any:
    if value == _MODEL:
        return model
    if isinstance(value, Mapping):
        return {k: _fill(v, model) for k, v in value.items()}
    return value


def cell_kwargs(feature: str, deployment: str, model: str = "tiny-model", default_model: bool = False) -> dict:
    """The engine settings of one cell: base + feature + deployment (``model``: the path
    of the served model, also the draft of ``spec_draft_model``; ``default_model``: the
    feature's settings for the default model).  A deployment's settings win over the
    feature's where both name one (they never do today)."""
    f, d = _FEATURE[feature], _DEPLOYMENT[deployment]
    fkw = f.default_kwargs if default_model and f.default_kwargs is not None else f.kwargs
    return {"model": model, **BASE_KWARGS, **_fill(dict(fkw), model), **d.kwargs}


def _windows(feature: Feature) -> list[int | None]:
    if feature.windows is not None:
        return list(feature.windows)
    return [None] * TINY_HF_CONFIG["num_hidden_layers"]


def cell_refusals(feature: str, deployment: str) -> list[str]:
    """The messages that refuse this cell (empty: it is allowed), checked as the engine
    checks them before any weights load."""
    from pagedserve import config_rules
    from pagedserve.entrypoints.engine_args import engine_config_from_kwargs
    from pagedserve.kv_cache.sliding_window import uniform_window
    from pagedserve.models.arch_config import ArchConfig

    f, d = _FEATURE[feature], _DEPLOYMENT[deployment]
    try:
        cfg = engine_config_from_kwargs(**cell_kwargs(feature, deployment))
    except ValueError as exc:
        return [str(exc)]
    windows = _windows(f)
    arch = ArchConfig.from_hf(TINY_HF_CONFIG)
    checks = [
        lambda: config_rules.check_parallel_fits_model(cfg, arch),
        lambda: config_rules.check_sliding_window_cache(cfg, uniform_window(windows)),
        lambda: config_rules.check_kv_cache_groups(cfg, windows),
    ]
    if d.data_parallel_size > 1:
        checks.append(lambda: config_rules.check_data_parallel(cfg, d.data_parallel_size))
    if d.disaggregated:
        checks.append(lambda: config_rules.check_disaggregated(cfg, windows))
        if f.disagg_request is not None:
            checks.append(lambda: _raise(config_rules.disaggregated_request_refusal(f.disagg_request)))
    out = []
    for check in checks:
        try:
            check()
        except ValueError as exc:
            if str(exc) not in out:
                out.append(str(exc))
    return out


def _raise(message: str) -> None:
    raise ValueError(message)


def suite_cells(features: Iterable[str], deployments: Iterable[str]) -> list[tuple[str, str]]:
    """The pairs of ``features`` x ``deployments`` that are not refused: the cells a
    module declaring ``COMPAT_FEATURES`` / ``COMPAT_DEPLOYMENTS`` runs and proves."""
    deployments = list(deployments)
    return [(f, d) for f in features for d in deployments if not cell_refusals(f, d)]


# -- the test inventory -------------------------------------------------------------------------


def _is_compat_mark(node: ast.AST) -> bool:
    """``pytest.mark.compat(...)`` or ``mark.compat(...)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.func.attr != "compat":
        return False
    owner = node.func.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
        isinstance(owner, ast.Name) and owner.id == "mark"
    )


class _MarkFinder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.stack: list[str] = []
        self.found: list[tuple[tuple[str, str] | None, str, int]] = []  # (cell or None if not literal, where, line)
        self.literals: dict[str, Any] = {}

    def _scope(self, node: ast.AST) -> None:
        self.stack.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Assign(self, node: ast.Assign) -> None:
        if not self.stack:
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in ("COMPAT_FEATURES", "COMPAT_DEPLOYMENTS"):
                    self.literals[target.id] = ast.literal_eval(node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _is_compat_mark(node):
            args = node.args
            literal = len(args) == 2 and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args)
            cell = (args[0].value, args[1].value) if literal else None  # type: ignore[attr-defined]
            self.found.append((cell, "::".join(self.stack), node.lineno))
        self.generic_visit(node)


def scan_tests(root: Path) -> tuple[dict[tuple[str, str], list[str]], list[str]]:
    """``(cell -> the tests that prove it, problems)`` from the test files under ``root``.

    A problem: a marker naming an unknown id, or one whose ids are not string literals in
    a module that declares no ``COMPAT_FEATURES`` / ``COMPAT_DEPLOYMENTS``.
    """
    cells: dict[tuple[str, str], list[str]] = {}
    problems: list[str] = []
    base = root.parent
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "compat" not in text:
            continue
        finder = _MarkFinder()
        finder.visit(ast.parse(text, filename=str(path)))
        rel = path.relative_to(base).as_posix()
        declared = "COMPAT_FEATURES" in finder.literals and "COMPAT_DEPLOYMENTS" in finder.literals
        pairs: list[tuple[tuple[str, str], str]] = []
        for cell, where, line in finder.found:
            if cell is None:
                if not declared:
                    problems.append(
                        f"{rel}:{line}: pytest.mark.compat needs two string literals (or the module declares "
                        "COMPAT_FEATURES and COMPAT_DEPLOYMENTS)"
                    )
                continue
            pairs.append((cell, f"{rel}::{where}" if where else rel))
        if declared:
            feats, deps = finder.literals["COMPAT_FEATURES"], finder.literals["COMPAT_DEPLOYMENTS"]
            unknown = [x for x in feats if x not in _FEATURE] + [x for x in deps if x not in _DEPLOYMENT]
            if unknown:
                problems.append(f"{rel}: COMPAT_FEATURES / COMPAT_DEPLOYMENTS name unknown ids {unknown}")
            else:
                pairs += [(cell, rel) for cell in suite_cells(feats, deps)]
        for (feature, deployment), where in pairs:
            if feature not in _FEATURE or deployment not in _DEPLOYMENT:
                problems.append(f"{where}: pytest.mark.compat({feature!r}, {deployment!r}) names an unknown id")
                continue
            tests = cells.setdefault((feature, deployment), [])
            if where not in tests:
                tests.append(where)
    return cells, problems


# -- the matrix ---------------------------------------------------------------------------------


@dataclass
class Cell:
    feature: str
    deployment: str
    refusals: list[str]
    tests: list[str]

    @property
    def state(self) -> str:
        if self.refusals:
            return "refused"
        return "works" if self.tests else "untested"


def build_matrix(tests_root: Path) -> tuple[list[Cell], list[str]]:
    """Every cell, row by row, and the inventory's problems (including a refused cell
    that a test claims works)."""
    tested, problems = scan_tests(tests_root)
    cells = []
    for f in FEATURES:
        for d in DEPLOYMENTS:
            cell = Cell(f.id, d.id, cell_refusals(f.id, d.id), tested.get((f.id, d.id), []))
            if cell.refusals and cell.tests:
                problems.append(
                    f"cell ({f.id}, {d.id}) is refused ({cell.refusals[0]}) but {', '.join(cell.tests)} "
                    "marks it as working"
                )
            cells.append(cell)
    return cells, problems


def matrix_problems(tests_root: Path) -> list[str]:
    return build_matrix(tests_root)[1]


#: What a reader of the matrix should know that no cell shows.
NOTES: tuple[str, ...] = (
    "A cell compares with one process on the same settings. `quantization` left at `auto` "
    "on a `.gguf` keeps its blocks in one process, under tensor/pipeline parallelism "
    "(sharded in blocks) and under `cpu_offload_gb` (streamed as blocks) but loads them "
    "dequantized under `device_map` (docs/quantization.md); the `quant_gguf` row asks for "
    "blocks explicitly (`quantization='gguf'`).",
    "Refusals are the engine's own messages for the tiny test model's shape (4 heads, 2 KV "
    "heads, 2 layers); a model whose heads or layers the ranks cannot split is refused by "
    "`check_parallel_fits_model` as well.",
    "`disagg` serves what `DisaggregatedLLM.generate` and `.beam_search` take (prompts, "
    "sampling parameters, priorities, adapters: the prefill instance runs each prompt under "
    "its adapter); embeddings have no decode phase and are refused.",
    "Tests that need Ray, peft, onnxruntime or the default model's package skip where it is missing; "
    "their cells count as tested from the marker.",
)

_SYMBOL = {"works": "✅", "refused": "⛔", "untested": "·"}


def render(cells: list[Cell]) -> str:
    """docs/compatibility.md."""
    by = {(c.feature, c.deployment): c for c in cells}
    counts = {s: sum(c.state == s for c in cells) for s in _SYMBOL}
    lines = [
        "# Compatibility: features x deployments",
        "",
        "<!-- Generated by `python -m pagedserve.testing.compat_matrix --write docs/compatibility.md`;",
        "     tests/test_compatibility_doc.py fails when this file differs. Do not edit by hand. -->",
        "",
        "Every cell is a feature used under a deployment, on the engine settings "
        "`base + feature + deployment` of `pagedserve.testing.compat_matrix`. A cell is",
        "",
        f"- {_SYMBOL['works']} **works**: a test marked `@pytest.mark.compat(feature, deployment)` shows its "
        "outputs equal to one process's (greedy tokens equal, logprobs within the distributed tests' "
        "tolerances, seeded samples equal);",
        f"- {_SYMBOL['refused']} **refused**: the engine refuses the combination before weights load, with "
        "the message listed below (`core/config_rules.py`);",
        f"- {_SYMBOL['untested']} **untested**: allowed, but no test proves it yet.",
        "",
        "No cell fails silently: a cell runs and matches one process (works), or it is refused.",
        "",
        f"**{counts['works']} work, {counts['refused']} are refused, {counts['untested']} are untested, "
        f"0 fail silently** (of {len(cells)} cells).",
        "",
        "| feature | " + " | ".join(f"`{d.id}`" for d in DEPLOYMENTS) + " |",
        "|---|" + "---|" * len(DEPLOYMENTS),
    ]
    for f in FEATURES:
        row = " | ".join(_SYMBOL[by[(f.id, d.id)].state] for d in DEPLOYMENTS)
        lines.append(f"| `{f.id}` ({f.title}) | {row} |")
    lines += ["", "Deployments:", ""]
    for d in DEPLOYMENTS:
        extra = [f"`{k}={v!r}`" for k, v in d.kwargs.items()]
        if d.data_parallel_size > 1:
            extra.append(f"`data_parallel_size={d.data_parallel_size}`")
        if d.disaggregated:
            extra.append("`DisaggregatedLLM`")
        lines.append(f"- `{d.id}`: {d.title}" + (f" ({', '.join(extra)})" if extra else ""))
    lines += ["", "Features:", ""]
    for f in FEATURES:
        how = [f"`{k}={v!r}`" for k, v in f.kwargs.items()]
        if f.request:
            how.append(f"per request: {f.request}")
        if f.windows is not None:
            how.append("a model whose layers have different attention windows")
        lines.append(f"- `{f.id}`: {f.title}" + (f" ({'; '.join(how)})" if how else ""))
    lines += ["", "## Notes", ""] + [f"- {n}" for n in NOTES]
    lines += ["", "## Refusals", ""]
    for c in cells:
        if c.refusals:
            lines.append(f"- `{c.feature}` x `{c.deployment}`: " + " / ".join(c.refusals))
    lines += ["", "## Tests proving the working cells", ""]
    for c in cells:
        if c.state == "works":
            lines.append(f"- `{c.feature}` x `{c.deployment}`: " + ", ".join(f"`{t}`" for t in c.tests))
    return "\n".join(lines) + "\n"


def _default_tests_root() -> Path:
    return Path.cwd() / "tests"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/compatibility.md from config_rules and the tests.")
    parser.add_argument("--write", metavar="PATH", help="write the matrix to PATH")
    parser.add_argument("--check", metavar="PATH", help="exit 1 when PATH differs from the generated matrix")
    parser.add_argument("--tests", metavar="DIR", default=None, help="the tests folder (default: ./tests)")
    args = parser.parse_args(argv)
    cells, problems = build_matrix(Path(args.tests) if args.tests else _default_tests_root())
    for p in problems:
        print(f"compat matrix: {p}", file=sys.stderr)
    text = render(cells)
    if args.check:
        if Path(args.check).read_text(encoding="utf-8") != text:
            print(
                f"{args.check} is out of date; run python -m pagedserve.testing.compat_matrix --write {args.check}",
                file=sys.stderr,
            )
            return 1
    elif args.write:
        Path(args.write).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
