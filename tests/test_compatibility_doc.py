"""docs/compatibility.md is generated from config_rules and the tests' compat markers, and
stays so: it is regenerated here and compared with the checked-in file.  The matrix's
machinery (marker scan, refusals per cell) is checked on small inputs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pagedserve import config_rules
from pagedserve.entrypoints.engine_args import engine_config_from_kwargs
from pagedserve.testing import compat_matrix as cm

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compatibility.md"
COMMAND = "python -m pagedserve.testing.compat_matrix --write docs/compatibility.md"


@pytest.fixture(scope="module")
def matrix():
    return cm.build_matrix(ROOT / "tests")


def test_doc_is_up_to_date(matrix):
    cells, _ = matrix
    assert DOC.read_text(encoding="utf-8") == cm.render(cells), f"docs/compatibility.md is stale; run {COMMAND}"


def test_no_refused_cell_is_claimed_and_every_marker_names_known_ids(matrix):
    _, problems = matrix
    assert problems == []


def test_every_feature_runs_in_one_process():
    """A feature's own settings are never refused alone: the single column is its base."""
    assert {f.id: cm.cell_refusals(f.id, "single") for f in cm.FEATURES} == {f.id: [] for f in cm.FEATURES}


def test_ids_are_the_contract():
    assert [f.id for f in cm.FEATURES] == [
        "prefix_caching",
        "chunked_prefill",
        "preemption_recompute",
        "preemption_swap",
        "n_best_of",
        "beam_search",
        "structured_outputs",
        "logits_processors",
        "spec_ngram",
        "spec_draft_model",
        "spec_self_quantized",
        "lora",
        "quant_gguf",
        "quant_int8",
        "quant_fp8",
        "quant_gptq_awq",
        "kv_groups",
        "pooling",
        "prompt_logprobs",
        "priority",
        "sleep_mode",
        "kv_connector",
    ]
    assert [d.id for d in cm.DEPLOYMENTS] == [
        "single",
        "tp_mp",
        "tp_ray",
        "pp",
        "tp_pp",
        "dp",
        "cpu_offload",
        "kv_offload",
        "device_map",
        "disagg",
        "plugin_ort",
    ]


def test_cell_kwargs_are_base_plus_feature_plus_deployment():
    kw = cm.cell_kwargs("spec_draft_model", "tp_mp", model="/m")
    assert kw["model"] == "/m" and kw["speculative_config"]["model"] == "/m"
    assert kw["tensor_parallel_size"] == 2 and kw["dtype"] == cm.BASE_KWARGS["dtype"]
    assert cm.cell_kwargs("n_best_of", "single", model="/m") == {"model": "/m", **cm.BASE_KWARGS}


def test_refusals_are_the_rules_messages():
    # The rule's own message, word for word, as the engine raises it before weights load
    # (a model-shape rule: groups of layers with different windows and a host KV tier
    # that could only spill, under preemption_mode="recompute"; the cell's tier swaps).
    cfg = engine_config_from_kwargs(**cm.cell_kwargs("kv_groups", "kv_offload"), preemption_mode="recompute")
    with pytest.raises(ValueError) as exc:
        config_rules.check_kv_cache_groups(cfg, [8, None])
    assert "kv_offload_memory" in str(exc.value) and "free_sliding_window_blocks=False" in str(exc.value)
    config_rules.check_kv_cache_groups(
        engine_config_from_kwargs(**cm.cell_kwargs("kv_groups", "kv_offload")), [8, None]
    )
    assert cm.cell_refusals("kv_groups", "kv_offload") == []
    # Deployment rules beside the engine.
    assert cm.cell_refusals("pooling", "dp") == cm.cell_refusals("lora", "dp") == []
    (message,) = cm.cell_refusals("kv_groups", "disagg")
    assert "disaggregated" in message and "free_sliding_window_blocks=False" in message


def _write(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(textwrap.dedent(text), encoding="utf-8")


def test_scan_finds_markers_and_declared_suites(tmp_path):
    _write(
        tmp_path,
        "test_a.py",
        """
        import pytest
        pytestmark = pytest.mark.compat("n_best_of", "tp_mp")

        @pytest.mark.compat("beam_search", "pp")
        @pytest.mark.compat("beam_search", "device_map")
        def test_one():
            pass

        class TestTwo:
            @pytest.mark.parametrize("x", [pytest.param(1, marks=pytest.mark.compat("priority", "dp"))])
            def test_three(self, x):
                pass
        """,
    )
    _write(
        tmp_path,
        "test_b.py",
        """
        import pytest
        COMPAT_FEATURES = ("lora", "prompt_logprobs")
        COMPAT_DEPLOYMENTS = ("tp_mp", "kv_offload")

        def _marks(f, d):
            return pytest.mark.compat(f, d)
        """,
    )
    cells, problems = cm.scan_tests(tmp_path)
    assert problems == []
    root = tmp_path.name
    assert cells[("n_best_of", "tp_mp")] == [f"{root}/test_a.py"]
    assert cells[("beam_search", "pp")] == [f"{root}/test_a.py::test_one"]
    assert cells[("beam_search", "device_map")] == [f"{root}/test_a.py::test_one"]
    assert cells[("priority", "dp")] == [f"{root}/test_a.py::TestTwo::test_three"]
    # The declared suite proves its pairs that are not refused, and only those.
    declared = {c for c, where in cells.items() if where == [f"{root}/test_b.py"]}
    expected = {(f, d) for f in ("lora", "prompt_logprobs") for d in ("tp_mp", "kv_offload")}
    assert declared == {c for c in expected if not cm.cell_refusals(*c)}


def test_scan_reports_unknown_ids_and_unreadable_markers(tmp_path):
    _write(
        tmp_path,
        "test_c.py",
        """
        import pytest
        F = "lora"

        @pytest.mark.compat("lora", "tp_nccl")
        @pytest.mark.compat(F, "tp_mp")
        def test_x():
            pass
        """,
    )
    _, problems = cm.scan_tests(tmp_path)
    assert len(problems) == 2
    assert any("'tp_nccl'" in p and "unknown id" in p for p in problems)
    assert any("string literals" in p for p in problems)


def test_a_refused_cell_claimed_by_a_test_is_a_problem(tmp_path, monkeypatch):
    _write(
        tmp_path,
        "test_d.py",
        """
        import pytest

        @pytest.mark.compat("kv_groups", "disagg")
        def test_y():
            pass
        """,
    )
    cells, problems = cm.build_matrix(tmp_path)
    assert len(problems) == 1 and "(kv_groups, disagg) is refused" in problems[0]
    by = {(c.feature, c.deployment): c.state for c in cells}
    assert by[("kv_groups", "disagg")] == "refused" and by[("n_best_of", "tp_mp")] == "untested"


def test_check_command_fails_on_a_stale_doc(tmp_path, capsys):
    stale = tmp_path / "compatibility.md"
    stale.write_text("old\n", encoding="utf-8")
    assert cm.main(["--check", str(stale), "--tests", str(tmp_path)]) == 1
    assert "--write" in capsys.readouterr().err
    assert cm.main(["--write", str(stale), "--tests", str(tmp_path)]) == 0
    assert cm.main(["--check", str(stale), "--tests", str(tmp_path)]) == 0
