"""Adapter sources: names that cannot escape a source, the directory and hub-cache resolvers, a resolver plugin found
through a real entry point (a dist-info on sys.path), the order of sources, `--multilora-adapter-root`, and the host
tier's choice of copies to drop."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from sgl_multilora.adapter_sources import (
    ENTRY_POINT_GROUP,
    AdapterSources,
    DirectoryResolver,
    HubCacheResolver,
    check_name,
    choose_drops,
    parse_source,
)
from sgl_multilora.adapters import AdapterError


def adapter(path, rank=8):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"x" * rank)
    return path


@pytest.mark.parametrize("name", ["a", "tenant-1.v2", "org/name", "A_b-c.d", "x" * 128])
def test_valid_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "..", "../x", "a/../b", "/etc", "a/b/c", ".hidden", "a//b", "a/", "x" * 129,
                                  "a\\b", "a b", "a\x00b", "a..b", 3, None])
def test_names_with_path_syntax_or_odd_characters_are_refused(name):
    with pytest.raises(AdapterError, match="not a valid adapter name|not a non-empty string"):
        check_name(name)


def test_directory_resolver_finds_adapters_by_name_and_never_outside(tmp_path):
    src = tmp_path / "src"
    adapter(src / "one")
    (src / "empty").mkdir()
    outside = adapter(tmp_path / "secret")
    (src / "link").symlink_to(outside)
    r = DirectoryResolver(str(src))
    assert r.resolve("one") == (src / "one").resolve()
    assert r.resolve("empty") is None and r.resolve("nothing") is None and r.resolve("org/one") is None
    with pytest.raises(AdapterError, match="outside the directories"):
        r.resolve("link")


def test_hub_cache_resolver_reads_the_revision_refs_main_names(tmp_path):
    repo = tmp_path / "models--org--name"
    blobs = repo / "blobs"
    blobs.mkdir(parents=True)
    for rev, rank in (("aaa", 8), ("bbb", 16)):
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        blob = adapter(blobs / rev, rank)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (snap / f).symlink_to(blob / f)  # huggingface_hub's layout: snapshot files link into blobs/
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa\n")
    r = HubCacheResolver(str(tmp_path))
    found = r.resolve("org/name")
    assert found.name == "aaa" and json.loads((found / "adapter_config.json").read_text())["r"] == 8
    (repo / "refs" / "main").unlink()  # no ref: the newest snapshot
    os.utime(repo / "snapshots" / "bbb", (time.time() + 5, time.time() + 5))
    assert r.resolve("org/name").name == "bbb"
    assert r.resolve("org/other") is None and r.resolve("name") is None


def test_sources_are_asked_in_order_and_an_unknown_name_is_refused_by_name(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    adapter(first / "shared")
    adapter(second / "shared")
    adapter(second / "only2")
    sources = AdapterSources([parse_source(str(first)), parse_source(str(second))])
    assert sources.resolve("shared").path == (first / "shared").resolve()
    assert sources.resolve("only2").source == str(second.resolve())
    with pytest.raises(AdapterError, match="LoRA adapter 'nope' is not loaded and no adapter source holds it") as e:
        sources.resolve("nope")
    assert str(tmp_path) not in str(e.value)  # the sources' paths are not revealed
    with pytest.raises(AdapterError, match="not a valid adapter name"):
        sources.resolve("../first/shared")


def test_a_source_outside_the_adapter_root_serves_nothing(tmp_path):
    adapter(tmp_path / "src" / "a")
    (tmp_path / "root").mkdir()
    sources = AdapterSources([parse_source(str(tmp_path / "src"))], root=str(tmp_path / "root"))
    with pytest.raises(AdapterError, match="--multilora-adapter-root"):
        sources.resolve("a")


def test_a_resolver_plugin_is_found_through_its_entry_point(tmp_path, monkeypatch):
    """A package declares `[sgl_multilora.adapter_resolvers] mystore = pkg:factory`; `mystore:ARG` then resolves
    through it (here a resolver that maps every name to one directory under ARG)."""
    site = tmp_path / "site"
    (site / "store_plugin").mkdir(parents=True)
    (site / "store_plugin" / "__init__.py").write_text(
        "from pathlib import Path\n"
        "class Store:\n"
        "    def __init__(self, arg): self.base = Path(arg)\n"
        "    def resolve(self, name):\n"
        "        p = self.base / ('cache-' + name)\n"
        "        return p if p.is_dir() else None\n")
    info = site / "store_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: store-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nmystore = store_plugin:Store\n")
    monkeypatch.syspath_prepend(str(site))
    adapter(tmp_path / "bucket" / "cache-x")
    scheme, arg = parse_source(f"mystore:{tmp_path / 'bucket'}")
    assert scheme == "mystore"
    sources = AdapterSources([(scheme, arg)])
    assert sources.resolve("x").path == tmp_path / "bucket" / "cache-x"
    assert sources.describe() == [f"mystore:{tmp_path / 'bucket'}"]
    with pytest.raises(AdapterError, match="no adapter source holds it"):
        sources.resolve("y")
    sys.modules.pop("store_plugin", None)


def test_parse_source_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="no adapter resolver is registered for 's3'.*hf-cache"):
        parse_source("s3:bucket/prefix")
    with pytest.raises(ValueError, match="is not a directory"):
        parse_source(str(tmp_path / "missing"))
    odd = tmp_path / "a:b"  # a directory whose name looks like a scheme is still a directory
    odd.mkdir()
    assert parse_source(str(odd)) == ("dir", str(odd.resolve()))


def test_host_drops_least_recently_used_first_keeping_what_must_stay():
    sizes = {"a": 40, "b": 30, "c": 20, "d": 10}
    order = ["a", "b", "c", "d"]  # least recently used first
    assert choose_drops(order, sizes, budget=100, keep=lambda n: False) == []
    assert choose_drops(order, sizes, budget=60, keep=lambda n: False) == ["a"]
    assert choose_drops(order, sizes, budget=35, keep=lambda n: False) == ["a", "b"]
    assert choose_drops(order, sizes, budget=35, keep=lambda n: n == "a") == ["b", "c", "d"]  # still 40 > 35
    assert choose_drops(order, sizes, budget=0, keep=lambda n: True) == []
