"""Builder.prebuild (pipeline/build.py): the distinct programs of a packaging round or of the
--gpu timing trials are compiled side by side (nvcc in threads, code generation in order), and
the `build` calls that follow are served what `build` alone would have made."""

from __future__ import annotations

import threading

import pytest

from mlso_cli.codegen import DEFAULT_TARGETS
from mlso_cli.codegen import nvcc as nvcc_mod
from mlso_cli.pipeline import build as build_mod
from mlso_cli.pipeline.build import Builder
from tests import test_codegen_graphs as T
from tests.helpers import fresh_cache

NAMES = ("elementwise_f32", "reductions_f16", "views_matmul_f16")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory):
    with fresh_cache(tmp_path_factory):
        yield


def test_prebuilt_programs_are_what_build_makes():
    programs = [T.GRAPHS[n]() for n in NAMES]
    alone = Builder(DEFAULT_TARGETS)
    want = [alone.build(p) for p in programs]
    pre = Builder(DEFAULT_TARGETS)
    assert pre.prebuild([(p, None) for p in programs + programs]) == len(NAMES)  # each once
    got = [pre.build(p) for p in programs]
    for w, g in zip(want, got):
        assert (g.binary, g.plan, g.source_sha256) == (w.binary, w.plan, w.source_sha256)
    assert pre.prebuild([(p, None) for p in programs]) == 0  # nothing left to compile


def test_build_after_prebuild_compiles_nothing(monkeypatch):
    programs = [T.GRAPHS[n]() for n in NAMES[:2]]
    b = Builder(DEFAULT_TARGETS)
    b.prebuild([(p, None) for p in programs])

    def refuse(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr("mlso_cli.codegen.compile_program", refuse)
    for p in programs:
        assert b.build(p).binary


def test_nvcc_runs_side_by_side(monkeypatch):
    """Two compiles must be in flight at once: each waits at a barrier of two (a serial loop
    would time out at the first)."""
    barrier = threading.Barrier(2, timeout=20)
    real = nvcc_mod.compile_generated

    def meeting(gp, targets):
        barrier.wait()
        return real(gp, targets)

    monkeypatch.setattr(nvcc_mod, "compile_generated", meeting)
    programs = [T.GRAPHS[n]() for n in NAMES[:2]]
    assert Builder(DEFAULT_TARGETS).prebuild([(p, None) for p in programs], jobs=2) == 2


def test_a_compile_error_surfaces_as_from_build(monkeypatch):
    def broken(gp, targets):
        raise nvcc_mod.CompileError("nvcc failed (exit 1) on generated CUDA", "report it")

    monkeypatch.setattr(nvcc_mod, "compile_generated", broken)
    programs = [T.GRAPHS[n]() for n in NAMES[:2]]
    with pytest.raises(nvcc_mod.CompileError, match="nvcc failed"):
        Builder(DEFAULT_TARGETS).prebuild([(p, None) for p in programs], jobs=2)
    assert build_mod._usable_cpus() >= 1
