"""The example scripts in docs/examples run as documented."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


def test_trainer_then_worker(tmp_path: Path):
    out = tmp_path / "run"
    trainer = subprocess.run(
        [sys.executable, str(EXAMPLES / "trainer.py"), str(out), "--steps", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert trainer.stdout.count("step ") == 3
    assert len(list(out.glob("step_*.pulse"))) == 3
    worker = subprocess.run(
        [sys.executable, str(EXAMPLES / "worker.py"), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    targets = [line.split()[-1] for line in trainer.stdout.splitlines() if line.startswith("step ")]
    applied = [
        line.split()[-1] for line in worker.stdout.splitlines() if line.startswith("applied")
    ]
    assert applied == [t.rstrip(")") for t in targets]


DOCS = EXAMPLES.parent
README = DOCS.parent / "README.md"
_FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
_SIGNATURE = re.compile(r"`\.?([A-Za-z_]\w*)\(([^`]*)\)(?: -> [^`]+)?`")


def _api_names() -> dict[str, Callable[..., Any]]:
    """The names docs/API.md and the README's Python example document, by the name they use."""
    torch_api = pytest.importorskip("pulsectl.torch_api")
    from pulsectl.apply import apply_patches
    from pulsectl.diff import DiffOptions, diff_checkpoints, diff_to_path
    from pulsectl.info import read_patch_info, verify_checkpoint
    from pulsectl.squash import squash_patches

    names: dict[str, Callable[..., Any]] = {
        "DiffOptions": DiffOptions,
        "diff_to_path": diff_to_path,
        "diff_checkpoints": diff_checkpoints,
        "apply_patches": apply_patches,
        "read_patch_info": read_patch_info,
        "verify_checkpoint": verify_checkpoint,
        "squash_patches": squash_patches,
        "anchor": torch_api.Publisher.anchor,
        "publish": torch_api.Publisher.publish,
    }
    names.update({name: getattr(torch_api, name) for name in torch_api.__all__})
    return names


def _parameters(func: Callable[..., Any]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(func).parameters.values() if p.name != "self"]


def test_api_doc_signatures_match_the_code():
    """Every `name(params)` span in docs/API.md names real parameters with their real defaults."""
    names = _api_names()
    text = _FENCE.sub("", (DOCS / "API.md").read_text())
    checked = set()
    for name, params in _SIGNATURE.findall(text):
        if name not in names:
            continue
        real = {p.name: p for p in _parameters(names[name])}
        positional = [p.name for p in real.values() if p.default is inspect.Parameter.empty]
        documented = [s.strip() for s in params.replace("\n", " ").split(",") if s.strip()]
        required = [s for s in documented if "=" not in s and s not in ("*", "...")]
        assert required == positional, f"{name}: documented {required}, code has {positional}"
        for item in documented:
            if "=" not in item:
                continue
            key, value = (s.strip() for s in item.split("=", 1))
            assert key in real, f"{name}: no parameter {key!r} (code: {list(real)})"
            if value != "...":
                assert ast.literal_eval(value) == real[key].default, f"{name}({key}=...)"
        checked.add(name)
    assert (
        set(names) - {"read_patch_info", "verify_checkpoint", "diff_to_path", "diff_checkpoints"}
        <= checked
    )


def test_the_package_says_it_is_typed():
    """The PEP 561 marker ships with the package (package-data), so that a user's type checker
    reads the API's annotations instead of treating pulsectl as untyped (docs/API.md)."""
    import importlib.resources

    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib is Python 3.11+")
    assert importlib.resources.files("pulsectl").joinpath("py.typed").is_file()
    project = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["pulsectl"]
    assert "typed" in (DOCS / "API.md").read_text().split("\n## ")[0]


def _calls(source: str) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]


def test_api_doc_examples_call_real_parameters():
    """The Python examples in docs/API.md and the README bind to the real signatures."""
    names = _api_names()
    blocks = [
        code
        for doc in (DOCS / "API.md", README)
        for lang, code in _FENCE.findall(doc.read_text())
        if lang == "python"
    ]
    bound = set()
    for call in (c for code in blocks for c in _calls(code)):
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in names:
            continue
        args = [None] * len(call.args)
        kwargs = {k.arg: None for k in call.keywords if k.arg is not None}
        inspect.signature(names[name]).bind(
            *([None] if name in ("anchor", "publish") else []), *args, **kwargs
        )
        bound.add(name)
    assert {"diff_to_path", "apply_patches", "Publisher", "anchor", "apply_patch"} <= bound


def _pulsectl(args: str, cwd: Path) -> str:
    """Run a README command line (``pulsectl ...``, bash brace expansion) in ``cwd``; stdout."""
    env = {**os.environ, "COLUMNS": "200"}
    command = args.replace("pulsectl ", f"{shlex.quote(sys.executable)} -m pulsectl ", 1)
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout


@pytest.fixture(scope="module")
def demo_chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's stats walk-through: its setup line, run as written."""
    section = README.read_text().split("## How sparse are my updates?")[1]
    setup = _FENCE.findall(section)[0][1].strip()
    # Its own folder: the README's opening already made `demo` (found in review: reusing it
    # failed, "is a folder that is not empty").
    assert setup == "pulsectl demo --keep demo4 --steps 4 && cd demo4/chain"
    root = tmp_path_factory.mktemp("readme")
    _pulsectl(setup.split(" && ")[0], root)
    return root / "demo4" / "chain"


def test_readme_stats_example_is_what_stats_prints(demo_chain: Path):
    """Each shown line of the README's `pulsectl stats` excerpt is a line of the real output."""
    section = README.read_text().split("## How sparse are my updates?")[1]
    shown = _FENCE.findall(section)[1][1]
    runs = re.split(r"^\$ ", shown, flags=re.M)[1:]
    assert len(runs) == 2
    for run in runs:
        command, *lines = run.splitlines()
        command = command.split("#")[0].strip()
        if importlib.util.find_spec("matplotlib") is None:
            command = re.sub(r" --plot \S+", "", command)
        printed = {line.rstrip() for line in _pulsectl(command, demo_chain).splitlines()}
        for line in lines:
            if line.strip() not in ("", "..."):
                assert line.rstrip() in printed, f"{command}: {line!r} is not in the output"


def _doc_json(doc: str, source: str) -> dict[str, Any]:
    for lang, code in _FENCE.findall(doc):
        if lang == "json" and f'"source": "{source}"' in code:
            return json.loads(re.sub(r"//.*", "", code))
    raise AssertionError(f"no {source} example")


def _same(doc: Any, real: Any) -> bool:
    """``doc`` is ``real`` as the docs trim it: floats rounded, lists cut short with "..."."""
    if isinstance(doc, float):
        digits = len(repr(doc).split(".")[1])
        return isinstance(real, float) and round(real, digits) == doc
    if isinstance(doc, dict):
        return doc.keys() == real.keys() and all(_same(v, real[k]) for k, v in doc.items())
    if isinstance(doc, list) and doc and doc[-1] == "...":
        return len(real) >= len(doc) - 1 and _same(doc[:-1], real[: len(doc) - 1])
    if isinstance(doc, list):
        return len(doc) == len(real) and all(_same(d, r) for d, r in zip(doc, real, strict=True))
    return doc == real


def test_stats_doc_json_is_what_stats_prints(demo_chain: Path):
    """docs/STATS.md's examples: the demo pair's and chain's --json, one entry per list kept."""
    text = (DOCS / "STATS.md").read_text()
    pair = json.loads(
        _pulsectl("pulsectl stats step_000.safetensors step_001.safetensors --json", demo_chain)
    )
    doc = _doc_json(text, "pair")
    keys = {"by_layer": "layer", "by_kind": "kind", "tensors": "name"}
    for field, value in doc.items():
        if field in keys:  # one entry per list: the real entry with the same key
            key = keys[field]
            for entry in value:
                real = [e for e in pair[field] if e[key] == entry[key]]
                assert real and _same(entry, real[0]), f"{field} {entry[key]}"
        else:
            assert _same(value, pair[field]), field
    chain = json.loads(
        _pulsectl("pulsectl stats step_00{0,1,2,3,4}.safetensors --json", demo_chain)
    )
    doc = _doc_json(text, "chain")
    real_steps = {s["k"]: s for s in chain.pop("steps")}  # the doc keeps only some k
    assert all(_same(s, real_steps[s["k"]]) for s in doc.pop("steps"))
    assert _same(doc, chain)


def test_every_cli_option_is_documented():
    """Every option name (long or short) appears somewhere in the README or docs/*.md.

    A weak guard: a new option name cannot go undocumented, but the same name documented for
    another command counts.
    """
    import typer

    from pulsectl.cli.app import app

    text = README.read_text() + "".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    missing = []

    def walk(command: Any, path: str) -> None:  # a click Command (typer may vendor click)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")
        for param in command.params:
            opts = [o for o in param.opts if o.startswith("-") and o != "--help"]
            if opts and not any(
                re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text) for o in opts
            ):
                missing.append(f"{path} {opts[0]}")

    walk(typer.main.get_command(app), "pulsectl")
    assert not missing
