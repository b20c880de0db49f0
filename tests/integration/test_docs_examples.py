"""The documentation's programs run as written against a real local cluster.

README.md's Python blocks run in order as one program (the second continues
the first); each block of docs/*.md marked ``<!-- tested: ... -->`` runs on
its own. They read the cluster's URI from ``BK_METADATA_URI``, as a user of
``bookie localcluster`` does."""

import os
import re
import subprocess
import sys

import pytest

from bk.testing import LocalCluster

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MARK = "<!-- tested: tests/integration/test_docs_examples.py -->"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks(path, marked_only):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    if not marked_only:
        return BLOCK.findall(text)
    blocks = [BLOCK.match(part.lstrip("\n")) for part in text.split(MARK)[1:]]
    assert all(blocks), f"{path}: a {MARK} line must come right before a python block"
    return [b.group(1) for b in blocks]


def _marked_pages():
    docs = os.path.join(ROOT, "docs")
    return [os.path.join("docs", f) for f in sorted(os.listdir(docs))
            if f.endswith(".md") and MARK in open(os.path.join(docs, f), encoding="utf-8").read()]


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    with LocalCluster(num_bookies=3, base_dir=str(tmp_path_factory.mktemp("docs"))) as c:
        yield c.metadata_uri


def _run(code, uri):
    env = dict(os.environ, BK_METADATA_URI=uri)
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    return r.stdout


def test_readme_first_program(uri):
    blocks = _blocks("README.md", marked_only=False)
    assert len(blocks) == 2 and _blocks("README.md", marked_only=True) == blocks
    out = _run("\n".join(blocks), uri).splitlines()
    assert out[:6] == ["last entry: 4", "0 b'hello'", "1 b'a'", "2 b'b'", "3 b'c'", "4 b'd'"]
    assert re.fullmatch(r"LogRecord\(position=Position\(segment=0, entry_id=0, slot=0\), "
                        r"data=b'hello, log'\)", out[6]), out[6]


def test_marked_examples_in_docs(uri):
    pages = _marked_pages()
    assert {"docs/client.md", "docs/logs.md"} <= set(pages)
    for page in pages:
        blocks = _blocks(page, marked_only=True)
        assert blocks, page
        for code in blocks:
            _run(code, uri)
