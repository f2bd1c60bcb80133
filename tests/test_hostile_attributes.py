"""Hostile JSON in an MlsoKernel's attributes: refused in one line, never a traceback.

Why: `json.loads` raises a plain ValueError (not JSONDecodeError) for an integer of more than
4300 digits (Python's int_max_str_digits) and a RecursionError for deep nesting; readers that
caught only JSONDecodeError let both escape as tracebacks (fixed in runtime/check.py first,
commit 20a078b; here in ir/serialize.py and package/unpack.py).
"""

from __future__ import annotations

import onnx
import pytest

from mlso_cli.ir.serialize import SchemaError, loads
from tests.fixtures.packaging import package_fixture, placeholder
from tests.fixtures.ugraphs import SMALL_FIXTURES
from tests.helpers import MODELS, run_cli

HUGE_INT = '{"schema": 1, "n": ' + "9" * 5000 + "}"
DEEP = "[" * 100_000 + "]" * 100_000
A = MODELS / "small" / "gated_mlp.onnx"


def _hostile(tmp_path, attribute: str, text: str):
    program = SMALL_FIXTURES["gated_mlp"]()
    model = package_fixture(A, program, placeholder(program))
    node = next(n for n in model.graph.node if n.domain == "ai.mlso")
    (attr,) = [a for a in node.attribute if a.name == attribute]
    attr.s = text.encode()
    path = tmp_path / "b.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("text", [HUGE_INT, DEEP], ids=["huge_int", "deep"])
def test_serialize_loads_refuses_hostile_json_with_a_schema_error(text):
    with pytest.raises(SchemaError, match="does not parse"):
        loads(text)


def test_serialize_loads_refuses_json_that_is_not_an_object():
    with pytest.raises(SchemaError, match="not an object"):
        loads("[1, 2]")


def test_unpack_describes_a_hostile_plan_without_verification_and_refuses_it_with():
    from mlso_cli.errors import InputError
    from mlso_cli.package import regions_in

    program = SMALL_FIXTURES["gated_mlp"]()
    model = package_fixture(A, program, placeholder(program))
    node = next(n for n in model.graph.node if n.domain == "ai.mlso")
    (attr,) = [a for a in node.attribute if a.name == "plan"]
    attr.s = HUGE_INT.encode()
    (view,) = regions_in(model, verify=False)
    assert view.plan is None
    with pytest.raises(InputError):
        regions_in(model)


def _error_lines(r) -> list[str]:
    err = r.stderr.decode()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("mlso: error:")]
    assert lines, err
    return lines


@pytest.mark.parametrize("attribute", ["ugraph", "plan"])
def test_inspect_refuses_a_huge_integer_in_an_attribute_in_one_line(tmp_path, attribute):
    b = _hostile(tmp_path, attribute, HUGE_INT)
    r = run_cli("inspect", str(b))
    assert r.returncode == 1, r.stderr
    problem, summary = _error_lines(r)  # inspect names each bad node, then sums them up
    assert f"attribute '{attribute}'" in problem and "failed their plan or hash check" in summary


@pytest.mark.parametrize("attribute", ["ugraph", "plan"])
def test_verify_refuses_a_huge_integer_in_an_attribute_in_one_line(tmp_path, attribute):
    """Exit 1, not 3: a model that is not what mlso wrote is refused before any comparison
    (docs/cli-errors.md: tampered models are input errors)."""
    b = _hostile(tmp_path, attribute, HUGE_INT)
    r = run_cli("verify", str(A), str(b), "--samples", "1", "--scales", "1", "--trust-binary")
    assert r.returncode == 1, r.stderr
    (line,) = _error_lines(r)
    assert f"attribute '{attribute}'" in line and "tampered" in line
