"""Stages codegen -> package: chosen programs become CUDA binaries, then MlsoKernel nodes.

Why a memo keyed by the program's content hash: with --gpu the same program is compiled for the
timing trials and again for the final model; code generation is pure, so once is enough (nvcc
keeps its own content-hash cache across runs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from mlso_cli.frontend.lift import LiftedRegion
from mlso_cli.frontend.load import LoadedModel, with_weights
from mlso_cli.ir.graph import KernelGraph
from mlso_cli.ir.hashing import graph_hash
from mlso_cli.package.assemble import Built


class Builder:
    """Compiles programs for `targets`, once per distinct program."""

    def __init__(self, targets: tuple[str, ...]) -> None:
        self.targets = tuple(targets)
        self._built: dict[str, Built] = {}

    def _key(self, program: KernelGraph, constants: Mapping[str, np.ndarray] | None) -> str:
        from mlso_cli.codegen.indexmask import computed_inputs
        from mlso_cli.codegen.selection import known_selections

        masks = computed_inputs(program, constants)
        selections = known_selections(program, constants)
        return (
            graph_hash(program)
            + "|"
            + ",".join(program.input_names)
            + "|"
            + ",".join(program.output_names)
            + "".join(f"|{i}:{m.describe()}" for i, m in sorted(masks.items()))
            + "".join(f"|{i}:select {s.digest}" for i, s in sorted(selections.items()))
        )

    def build(
        self, program: KernelGraph, constants: Mapping[str, np.ndarray] | None = None
    ) -> Built:
        """`constants`: the region's lifted constants (LiftedRegion.extra_inputs); a mask among
        them that is an index predicate is computed in the code, not read (codegen/indexmask.py)."""
        from mlso_cli.codegen import compile_program

        key = self._key(program, constants)
        got = self._built.get(key)
        if got is None:
            compiled = compile_program(program, self.targets, constants)
            got = Built(program, compiled.fatbin, compiled.plan, compiled.source_sha256)
            self._built[key] = got
        return got

    def prebuild(
        self,
        items: Sequence[tuple[KernelGraph, Mapping[str, np.ndarray] | None]],
        jobs: int | None = None,
    ) -> int:
        """Compile the programs of `items` that are not built yet, nvcc runs side by side, so that
        the `build` calls that follow find them. Returns how many were compiled here.

        Why: `optimize --gpu` builds each region's top picks for its timing trials, one program
        after another, and every distinct program is an nvcc run of seconds (Phi-3's 2-layer
        export: 6 distinct regions, up to 4 picks each). Code generation stays in this thread
        (pure Python, in order); only nvcc, a subprocess, runs in `jobs` threads (default: the
        CPUs this process may use), so the programs and binaries are the ones `build` makes."""
        from concurrent.futures import ThreadPoolExecutor

        from mlso_cli.codegen import generate
        from mlso_cli.codegen.nvcc import compile_generated

        todo: dict[str, tuple[KernelGraph, object]] = {}
        for program, constants in items:
            key = self._key(program, constants)
            if key not in self._built and key not in todo:
                todo[key] = (program, generate(program, self.targets, constants))
        if len(todo) < 2:
            return 0  # one program: `build` compiles it as before
        workers = min(jobs or _usable_cpus(), len(todo))
        ex = ThreadPoolExecutor(max(1, workers), thread_name_prefix="mlso-nvcc")
        try:
            futures = {
                key: ex.submit(compile_generated, gen, self.targets)
                for key, (_, gen) in todo.items()
            }
            for key, future in futures.items():
                compiled = future.result()  # a CompileError is raised as `build` would raise it
                self._built[key] = Built(
                    todo[key][0], compiled.fatbin, compiled.plan, compiled.source_sha256
                )
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
        return len(todo)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else the count)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def package(
    loaded: LoadedModel,
    items: Sequence[tuple[LiftedRegion, Built]],
    *,
    targets: tuple[str, ...],
    seed: int,
    bound: float,
    extra: Mapping[str, str] | None = None,
    consume: bool = False,
) -> onnx.ModelProto:
    """The input model with each (region, program) replaced by an MlsoKernel node, and mlso's
    metadata: `bound` is the run's verification bound (mlso.verification_bound); `extra` adds
    keys (mlso.serve). `consume`: `loaded.model` itself becomes the packaged model (no copy of
    its weights); `loaded` must not be used after (pipeline/run.py loads the file again)."""
    from mlso_cli.package import standard_metadata
    from mlso_cli.package.assemble import assemble

    meta = standard_metadata(targets=targets, seed=seed, verification_bound=bound)
    meta.update(extra or {})
    # assemble copies the model (once): `loaded` stays as it is for the next packaging round;
    # a model given its external data here is a copy already
    model = with_weights(loaded)
    return assemble(model, list(items), meta, copy=not consume and model is loaded.model)


def set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    """Set one metadata_props key in place, keeping the keys sorted as the packager writes
    them. Why after packaging: the whole-model check's verdict exists only once both models
    were built and timed."""
    props = {p.key: p.value for p in model.metadata_props}
    props[key] = value
    del model.metadata_props[:]
    for k in sorted(props):
        model.metadata_props.add(key=k, value=props[k])
