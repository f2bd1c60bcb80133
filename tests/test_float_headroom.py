"""The float check's headroom (VerifyOptions.float_headroom): optimize checks against a fraction
of the limit (verifying.CHECK_FLOAT_HEADROOM), so that `mlso verify` on another machine does not
refuse what it wrote, yet a kernel as accurate as the original region passes."""

from __future__ import annotations

from mlso_cli.pipeline import verifying
from mlso_cli.verify import packaged
from tests.fixtures.ugraphs import fixture


def test_headroom_scales_the_limit():
    prog = fixture("rmsnorm_linear", small=True)
    ok: dict = {}
    packaged._float_check(ok, prog, prog, seed=3, headroom=1.0)
    assert ok["float_check"].startswith("ok")  # its own float32 error is within 2x itself
    tight: dict = {}
    packaged._float_check(tight, prog, prog, seed=3, headroom=1e-9)
    assert tight["float_check"].startswith("FAILED") and "headroom" in tight["float_check"]
    assert tight["equivalent"] is False and tight["status"] == "float"


def test_a_kernel_as_accurate_as_the_original_passes_the_check_before_writing(monkeypatch):
    """The Phi-3 attention case at real width: the kernel's error 0.00208, the region's own
    float32 error 0.002 (fp16 limit 0.002). The limit is twice the region's own error, so any
    headroom at or under 0.5 refused a kernel as accurate as the original."""
    prog = fixture("rmsnorm_linear", small=True)
    errors = iter([0.00208, 0.002] * len(prog.outputs))  # _rel(program), then _rel(reference)
    monkeypatch.setattr(packaged, "_rel", lambda got, want: next(errors))
    row: dict = {}
    packaged._float_check(row, prog, prog, seed=3, headroom=verifying.CHECK_FLOAT_HEADROOM)
    assert row["float_check"].startswith("ok"), row["float_check"]
    errors = iter([0.00208, 0.002] * len(prog.outputs))
    half: dict = {}
    packaged._float_check(half, prog, prog, seed=3, headroom=0.5)
    assert half["float_check"].startswith("FAILED")
    errors = iter([0.0041, 0.002] * len(prog.outputs))  # over twice its own: refused by both
    worse: dict = {}
    packaged._float_check(worse, prog, prog, seed=3, headroom=1.0)
    assert worse["float_check"].startswith("FAILED")


def test_the_check_before_writing_keeps_a_margin(monkeypatch, tmp_path):
    from mlso_cli.pipeline import PipelineOptions, optimize
    from mlso_cli.search.api import SearchOptions
    from tests.test_pipeline import SRC, FakeSearch

    seen = []
    real = verifying.verify_models

    def spy(original, model, options, **kw):
        seen.append(options.float_headroom)
        return real(original, model, options, **kw)

    monkeypatch.setattr(verifying, "verify_models", spy)
    opts = PipelineOptions(
        search=SearchOptions(max_states=10, seed=0), min_speedup=0.0, use_cache=False
    )
    out = optimize(str(SRC), None, opts, search=FakeSearch())
    assert any(r.choice.packaged for r in out.regions)
    assert seen and set(seen) == {verifying.CHECK_FLOAT_HEADROOM}
    assert packaged.VerifyOptions(seed=1).float_headroom == 1.0  # verify keeps the full limit


def test_the_float_check_draws_from_the_kernel_not_the_run_seed(monkeypatch):
    """optimize and verify run with different seeds; the float check must see the same inputs
    on both sides, or a kernel near its limit passes one and fails the other."""
    from mlso_cli.pipeline import PipelineOptions, optimize
    from mlso_cli.search.api import SearchOptions
    from tests.test_pipeline import SRC, FakeSearch

    seeds = []
    real = packaged._float_check

    def spy(row, reference, program, seed, headroom=1.0):
        seeds.append(seed)
        return real(row, reference, program, seed, headroom)

    monkeypatch.setattr(packaged, "_float_check", spy)
    for vseed in (5, 6):
        opts = PipelineOptions(
            search=SearchOptions(max_states=10, seed=0),
            min_speedup=0.0,
            use_cache=False,
            verify_seed=vseed,
        )
        optimize(str(SRC), None, opts, search=FakeSearch())
    assert len(seeds) == 2 and seeds[0] == seeds[1]
    other = fixture("lora", small=True)
    assert packaged._float_seed(other) != seeds[0]
