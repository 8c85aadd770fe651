"""The user guide: it builds with ``mkdocs build --strict``, its Python snippets run against
the library (and a real replica where they sync), its plots are what their data draws,
every row of ``weightsync doctor`` has its troubleshooting entry, and the wire protocol page
names every route, field and capability the reference server serves.

Every ```` ```python ```` block of a page runs, in order, in one namespace per page; a page
whose snippets name ``checkpoint``, ``urls`` or ``api_key`` gets them from a real replica of
the reference server. Code that cannot run here (it needs GPUs, a cluster or another
framework) is fenced ```` ```py ````, which renders the same and is not run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from servers import start_replicas
from weightsync.cli.doctor_checks import HOST_CHECKS, REPLICA_CHECKS
from weightsync.control import protocol
from weightsync.testing.presets import preset_config, write_random_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# A fenced block whose info string is exactly "python" is executed; ```bash blocks are not.
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PAGES = [page for page in sorted(DOCS.glob("*.md")) if SNIPPET.search(page.read_text())]
# What the guide's sync snippets take as given: a checkpoint, running replicas and their key.
GIVEN = ("checkpoint", "urls", "api_key")
API_KEY = "docs-snippet-key"


def _need_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed: scripts/setup --tests installs the [docs] extra")
        pytest.skip("mkdocs is not installed here (scripts/setup --tests installs it)")


def test_the_guide_builds_with_strict_checks(tmp_path):
    _need_mkdocs()
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # The reference is generated from the docstrings, not written by hand.
    assert "lifecycle_timeout_s" in api and "check_weight_update_equal" in api
    assert (tmp_path / "site" / "img" / "gpu_sync.svg").is_file()


@pytest.fixture(scope="module")
def given(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("docs")
    checkpoint = write_random_checkpoint(root / "ckpt", preset_config("tiny"), seed=5)
    (served,) = start_replicas(checkpoint, tp=1, api_key=API_KEY, log_dir=root / "logs")
    try:
        yield {"checkpoint": str(checkpoint), "urls": [served.url], "api_key": API_KEY}
    finally:
        served.stop()


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_snippets_of_a_page_run(page, request):
    snippets = SNIPPET.findall(page.read_text())
    source = "\n".join(snippets)
    uses = [name for name in GIVEN if re.search(rf"\b{name}\b", source)]
    namespace = dict(request.getfixturevalue("given")) if uses else {}
    for index, snippet in enumerate(snippets):
        code = compile(snippet, f"{page.name} snippet {index + 1}", "exec")
        exec(code, namespace)


def test_the_pages_that_show_the_api_have_snippets():
    assert {"quickstart.md", "concepts.md", "sglang.md"} <= {page.name for page in PAGES}


def test_the_plots_are_what_their_data_draws():
    plots = runpy.run_path(str(DOCS / "plots.py"))["render"]()
    assert plots, "docs/plots.py draws nothing"
    for path, text in plots.items():
        assert (DOCS / path).read_text() == text, f"run python docs/plots.py to redraw {path}"


def test_every_doctor_check_has_a_troubleshooting_entry_in_order():
    headings = re.findall(r"^### (.+)$", (DOCS / "troubleshooting.md").read_text(), re.M)
    assert headings == [*HOST_CHECKS, *REPLICA_CHECKS]


def test_the_protocol_page_names_every_route_field_and_capability():
    page = (DOCS / "protocol.md").read_text()
    openapi = json.loads((ROOT / "tests" / "openapi_main.json").read_text())
    routes = [path for path in openapi["paths"] if not re.search(re.escape(path) + r"[`?]", page)]
    assert not routes, f"docs/protocol.md does not name the routes {routes}"
    fields = [
        f"{name}.{field}"
        for name, schema in openapi["components"]["schemas"].items()
        if "ValidationError" not in name
        for field in schema.get("properties", {})
        if f'"{field}"' not in page and f"`{field}`" not in page
    ]
    assert not fields, f"docs/protocol.md does not name the fields {fields}"
    capabilities = [
        value
        for name, value in vars(protocol).items()
        if name.isupper() and isinstance(value, str) and f"`{value}`" not in page
    ]
    assert not capabilities, f"docs/protocol.md does not name the capabilities {capabilities}"
