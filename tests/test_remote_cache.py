"""The search cache at an fsspec URL (search/remote_cache.py): the same contract as on a local
directory. Why: drivers sharing a cluster share the cache on storage every node sees, so an
entry there must be whole when found and checked before it is trusted, as on a local disk.
`memory://` stands in for an object store and `file://` for a mounted shared directory."""

from __future__ import annotations

import contextlib
import json
import uuid

import pytest
from click.testing import CliRunner

from mlso_cli import knobs as knobs_mod
from mlso_cli.cli import main
from mlso_cli.search.cache import SearchCache
from mlso_cli.search.remote_cache import FsspecSearchCache, open_search_cache
from tests.helpers import MODELS
from tests.test_search_cache import _key, _result

fsspec = pytest.importorskip("fsspec", reason="fsspec is not installed (pip install 'mlso[ray]')")


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    if request.param == "memory":
        u = f"memory://mlso-test-{uuid.uuid4().hex}/search"
        yield u
        with contextlib.suppress(FileNotFoundError):  # nothing was written
            fsspec.filesystem("memory").rm(u.split("://", 1)[1].split("/")[0], recursive=True)
    else:
        yield f"file://{tmp_path}/shared/search"


def test_a_url_opens_an_fsspec_cache_and_a_path_a_directory_one(url, tmp_path):
    assert isinstance(open_search_cache(url), FsspecSearchCache)
    plain = open_search_cache(tmp_path / "d")
    assert type(plain) is SearchCache and plain.root == tmp_path / "d"


def test_get_returns_what_put_stored_and_leaves_no_temporary(url):
    c = open_search_cache(url)
    key, r = _key(), _result()
    assert c.get(key) is None
    assert c.put(key, r)
    assert c.get(key) == r
    assert open_search_cache(url).get(key) == r  # another driver sees the same entry
    names = c.fs.find(c.root_path)
    assert names == [c.location(key)], names  # one entry, no .tmp left behind


def test_a_partial_result_is_not_stored(url):
    c = open_search_cache(url)
    assert not c.put(_key(), _result(partial=True))
    assert c.get(_key()) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_entry_is_a_miss(url, damage):
    c = open_search_cache(url)
    key = _key()
    c.put(key, _result())
    raw = c.fs.cat_file(c.location(key))
    bad = {
        "flip": raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:],
        "truncate": raw[: len(raw) // 2],
        "empty": b"",
    }[damage]
    c.fs.pipe_file(c.location(key), bad)
    assert c.get(key) is None
    c.put(key, _result())  # a later run repairs it
    assert c.get(key) == _result()


def test_an_entry_under_another_key_is_a_miss(url):
    c = open_search_cache(url)
    k1, k2 = _key(), _key(targets=("sm_90",))
    c.put(k1, _result())
    c.fs.makedirs(c.location(k2).rsplit("/", 1)[0], exist_ok=True)
    c.fs.pipe_file(c.location(k2), c.fs.cat_file(c.location(k1)))
    assert c.get(k2) is None


def test_optimize_with_a_url_cache_searches_once(url, monkeypatch, tmp_path):
    """Two drivers (here one after the other) with one MLSO_SEARCH_CACHE: the second is served
    every region from the first's entries."""
    monkeypatch.setenv("MLSO_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("MLSO_SEARCH_CACHE", url)
    knobs_mod.cache_clear()
    try:
        args = ["optimize", str(MODELS / "small" / "lora.onnx"), "--dry-run", "--json"]
        args += ["--max-states", "2000", "--jobs", "1"]
        runs = []
        for _ in range(2):
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 0, r.output
            runs.append([json.loads(x) for x in r.output.splitlines() if x.startswith("{")][-1])
        assert runs[0]["searched"] >= 1 and runs[0]["cached"] == 0
        assert runs[1]["cached"] == runs[0]["searched"]
        assert not (tmp_path / "local" / "search").exists()  # the results went to the URL
    finally:
        knobs_mod.cache_clear()
