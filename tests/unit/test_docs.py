"""The documentation stays true: the generated configuration reference is
current, links stay inside the repository and resolve, the README stays short,
and every bkshell command is documented."""

import importlib.util
import os
import re

from bk.cli.shell import cli as bkshell
from bk.config import SECTIONS, SETTINGS, sections

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = os.path.join(ROOT, "docs")
PAGES = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _gen_conf():
    spec = importlib.util.spec_from_file_location("gen_conf",
                                                  os.path.join(ROOT, "scripts", "gen_conf.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def _anchors(text):
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_configuration_reference_is_current():
    for name, text in _gen_conf().expected_docs().items():
        assert _read(os.path.join(DOCS, name)) == text, \
            f"docs/{name} is stale: run python scripts/gen_conf.py"


def test_sections_cover_every_setting_in_registry_order():
    grouped = [s.name for _, settings in sections() for s in settings]
    assert grouped == list(SETTINGS)
    assert [title for title, _ in sections()] == [title for title, _ in SECTIONS]
    reference = _read(os.path.join(DOCS, "configuration.md"))
    for title, settings in sections():
        assert f"\n## {title}\n" in reference
        for s in settings:
            assert f"| `{s.name}` |" in reference


def test_readme_is_short_and_links_stay_in_the_repository():
    assert len(_read(os.path.join(ROOT, "README.md")).splitlines()) <= 200
    for page in PAGES:
        text = _read(page)
        assert "/shared" not in text, f"{page} points outside the repository"
        for target in LINK.findall(text):
            assert "://" not in target and not target.startswith("/"), \
                f"{os.path.relpath(page, ROOT)} links outside the repository: {target}"
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.exists(dest), f"{os.path.relpath(page, ROOT)}: broken link {target}"
            if anchor:
                assert anchor in _anchors(_read(dest)), \
                    f"{os.path.relpath(page, ROOT)}: no heading for #{anchor} in {path or 'itself'}"


def test_every_docs_page_is_in_the_index():
    index = _read(os.path.join(DOCS, "README.md"))
    readme = _read(os.path.join(ROOT, "README.md"))
    for page in PAGES[1:]:
        name = os.path.basename(page)
        if name != "README.md":
            assert f"]({name})" in index and f"](docs/{name})" in readme, name


def test_every_bkshell_command_is_documented():
    docs = "".join(_read(p) for p in PAGES)
    names = [n for n in bkshell.commands if n != "bench"]
    names += [f"bench {n}" for n in bkshell.commands["bench"].commands]
    missing = [n for n in names if f"`{n}" not in docs]
    assert not missing, f"bkshell commands missing from README.md and docs/: {missing}"


def test_ci_runs_exactly_the_readme_test_command():
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    assert "exec scripts/test.sh" in ci
    assert "scripts/test.sh" in _read(os.path.join(ROOT, "README.md"))


def test_architecture_names_every_module_of_the_package():
    text = _read(os.path.join(DOCS, "architecture.md"))
    pkg = os.path.join(ROOT, "bk")
    names = [f"bk/{n}" for n in sorted(os.listdir(pkg))
             if n.endswith(".py") and n != "__init__.py"]
    names += [f"bk/{n}/" for n in sorted(os.listdir(pkg))
              if os.path.isfile(os.path.join(pkg, n, "__init__.py"))]
    missing = [n for n in names if n not in text]
    assert not missing, f"add {missing} to the module map of docs/architecture.md"
