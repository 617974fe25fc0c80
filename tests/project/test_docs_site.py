"""The documentation site (mkdocs.yml, docs/) builds in strict mode: a broken link, a missing anchor or page, or an
API reference that names something the sources lack fails; the built API reference shows each configuration class's
constructor with every field and the Accelerator's constructor, and no member signature is a line of source (the site
is built once for the module). CI installs the `docs` extra (scripts/install.sh --test),
so there the test runs; elsewhere it is skipped when mkdocs is missing."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site, built once with --strict for every test of this module: (the build's result, its directory)."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("CI must install the docs extra (bash scripts/install.sh --test installs it)")
        pytest.skip("mkdocs not installed: bash scripts/install.sh --docs")
    site = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return result, site


def test_site_builds_strict(built_site):
    result, site = built_site
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    assert "WARNING" not in result.stderr, result.stderr[-6000:]
    assert (site / "search" / "search_index.json").is_file()  # Material's built-in search has its index
    # the API reference was generated from the docstrings (not an empty page)
    assert "prepare" in (site / "reference" / "accelerator" / "index.html").read_text()


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _signatures(fragment: str) -> list[str]:
    """The text of each signature block (mkdocstrings' ``doc-signature``) in `fragment`, in order."""
    return [" ".join(_text(s).split()) for s in re.findall(r'<div class="doc-signature[^"]*"[^>]*>(.*?)</div>',
                                                                fragment, re.S)]


def _reference_section(site: Path, name: str) -> str:
    """The HTML of ``ndparallel.<name>``'s entry in the built API reference, from its heading on."""
    for page in sorted((site / "reference").glob("*/index.html")):
        text = page.read_text()
        start = text.find(f'id="ndparallel.{name}"')
        if start != -1:
            return text[start:]
    raise AssertionError(f"no page of the API reference has an entry for ndparallel.{name}")


def _constructor(site: Path, name: str) -> str | None:
    """The constructor signature of ``ndparallel.<name>`` in the built API reference (None when it shows none)."""
    signatures = _signatures(_reference_section(site, name))
    return signatures[0] if signatures and signatures[0].startswith(f"{name}(") else None


def _has_parameter(signature: str, name: str) -> bool:
    return re.search(rf"[(,]\s*\**{re.escape(name)}\s*[:=,)]", signature) is not None


def test_api_reference_shows_every_field_of_each_configuration_class(built_site):
    """The built page of each public configuration class (the dataclasses of `ndparallel.__all__`: ParallelismConfig,
    its handlers, the plugins and kwargs handlers) shows its constructor with every field, by name."""
    import dataclasses

    import ndparallel

    result, site = built_site
    assert result.returncode == 0, result.stderr[-6000:]
    classes = [name for name in ndparallel.__all__
               if isinstance(getattr(ndparallel, name), type) and dataclasses.is_dataclass(getattr(ndparallel, name))]
    assert {"ParallelismConfig", "TorchContextParallelConfig", "FullyShardedDataParallelPlugin"} <= set(classes)
    missing = {}
    for name in classes:
        signature = _constructor(site, name) or ""
        fields = [f.name for f in dataclasses.fields(getattr(ndparallel, name)) if f.init]
        absent = [f for f in fields if not _has_parameter(signature, f)]
        if absent:
            missing[name] = absent
    assert not missing, f"the API reference's constructor signatures lack these fields: {missing}"


def test_api_reference_shows_accelerator_constructor_and_real_member_signatures(built_site):
    """Accelerator's page shows its constructor with each of its parameters and an entry for each public attribute, and
    no member's signature is the line of source that made it (``device = property(lambda self: ...)``,
    ``clear = free_memory``)."""
    import inspect

    import ndparallel

    result, site = built_site
    assert result.returncode == 0, result.stderr[-6000:]
    signature = _constructor(site, "Accelerator")
    assert signature, "the API reference shows no constructor signature for ndparallel.Accelerator"
    parameters = [p for p in inspect.signature(ndparallel.Accelerator).parameters]
    absent = [p for p in parameters if not _has_parameter(signature, p)]
    assert not absent, f"Accelerator's constructor signature in the API reference lacks {absent}: {signature}"
    section = _reference_section(site, "Accelerator")
    raw = [s for s in _signatures(section)[1:] if re.match(r"\w+(: [^=]+)? = ", s)]
    assert not raw, f"{len(raw)} member signatures of Accelerator's page are source lines, e.g. {raw[:5]}"
    # every public attribute of the class has an entry (``a, b = ...`` in a class body is invisible to griffe)
    entries = set(re.findall(r'id="ndparallel\.Accelerator\.(\w+)"', section))
    undocumented = [name for name in dir(ndparallel.Accelerator) if not name.startswith("_") and name not in entries]
    assert not undocumented, f"Accelerator's page has no entry for {undocumented}"


FACES = ["ndparallel", "ndparallel.utils", "ndparallel.state", "ndparallel.data_loader", "ndparallel.big_modeling",
         "ndparallel.accelerator", "ndparallel.parallelism_config"]


def test_api_reference_documents_every_public_name():
    """Each name of `ndparallel.__all__` and of Accelerate's module paths has a `::: path` entry in docs/reference/,
    under the face itself or under `ndparallel` (where a name both export, it is documented once)."""
    import importlib

    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "reference").glob("*.md")))
    entries = set(re.findall(r"^::: (\S+)$", text, re.M))
    top = set(importlib.import_module("ndparallel").__all__)
    missing = [f"{face}.{name}" for face in FACES for name in importlib.import_module(face).__all__
               if name != "__version__" and f"{face}.{name}" not in entries
               and not (name in top and f"ndparallel.{name}" in entries)]
    assert not missing, f"docs/reference/ has no `::: ...` entry for {missing}"
