"""Mutation fuzzing of the loaders: damaged GGUF files and safetensors folders.

Each mutated checkpoint is opened (config, tensor checks), its tokenizer built and every
weight read, in a child process under an address-space cap and a timeout. The only
acceptable outcomes are a successful load or a ModelLoadError / ValueError-family error
that names the file; a crash, a hang, another exception type or a huge allocation fails.
The short run (about 100 mutations) is part of the suite; ``make fuzz-loader`` runs the
long one (``slow``).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from .capped import run_capped
from .mutations import Mutation, apply, gguf_mutations, safetensors_mutations
from .tiny_checkpoints import write_tiny_gguf, write_tiny_safetensors

# Loads each (path, mutation) given on stdin-free argv: results as @@-prefixed JSON lines.
_CHILD = """
import json, sys
from pagedserve.loader import open_model
cases = json.loads(open({cases!r}).read())
for path, name in cases:
    print("@@" + json.dumps({{"start": name}}), flush=True)
    try:
        source = open_model(path)
        source.tokenizer()
        for _ in source.weights():
            pass
        result = {{"ok": name}}
    except Exception as e:
        result = {{"name": name, "type": type(e).__name__, "value_error": isinstance(e, ValueError),
                  "message": str(e)[:500]}}
    print("@@" + json.dumps(result), flush=True)
print("@@" + json.dumps({{"done": True}}), flush=True)
"""


def _fuzz(tmp_path: pathlib.Path, n: int, seed: int, timeout: float) -> None:
    (tmp_path / "base").mkdir()
    base_gguf = write_tiny_gguf(tmp_path / "base" / "tiny.gguf")
    base_st = write_tiny_safetensors(tmp_path / "base" / "tiny")
    mutations: list[tuple[pathlib.Path, Mutation]] = [
        *((base_gguf, m) for m in gguf_mutations(base_gguf, n // 2, seed)),
        *((base_st, m) for m in safetensors_mutations(base_st, n - n // 2, seed + 1)),
    ]
    cases, names = [], {}
    for i, (base, m) in enumerate(mutations):
        dest = tmp_path / "m" / f"{i:05d}" / (base.name if base.is_file() else "ckpt")
        path = apply(m, base, dest)
        name = f"#{i} {m}"  # one mutation may be drawn twice: the index keeps names unique
        cases.append((str(path), name))
        names[name] = str(path)
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    rc, reports, err = run_capped(_CHILD.format(cases=str(spec)), cap_bytes=6 * 2**30, timeout=timeout)
    started = [r["start"] for r in reports if "start" in r]
    assert rc == 0 and reports and reports[-1].get("done"), (
        f"the loader child died (rc {rc}) on mutation {started[-1] if started else '?'}: {err[-3000:]}"
    )
    bad = []
    for r in reports:
        if "type" not in r:
            continue
        where = names[r["name"]]
        if not r["value_error"] or where not in r["message"]:
            bad.append(f"{r['name']}: {r['type']}: {r['message']}")
    assert not bad, f"{len(bad)} mutations gave an unnamed or non-ValueError failure:\n" + "\n".join(bad[:20])
    loaded = sum("ok" in r for r in reports)
    failed = sum("type" in r for r in reports)
    assert loaded + failed == len(cases)
    print(f"{len(cases)} mutations: {loaded} loaded, {failed} refused by name")
    assert failed > len(cases) // 4  # the mutations do damage: most are refused


def test_loader_mutations_short(tmp_path: pathlib.Path) -> None:
    _fuzz(tmp_path, n=100, seed=0, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_loader_mutations_long(tmp_path: pathlib.Path, seed: int) -> None:
    _fuzz(tmp_path, n=2000, seed=seed * 1000, timeout=1800)
