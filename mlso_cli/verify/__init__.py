"""Verification: the numpy interpreter, finite-field fingerprints with a stated bound, float checks.

Why three tools: the interpreter makes every mapping of a μGraph observable on the CPU; the field
check proves exact-semantics equivalence with a false-accept bound (docs/verification.md);
the float check catches what exact semantics cannot (overflow, storage rounding, a missing
softmax stabiliser). Module map:
  walk.py         the one literal op walk (kernel, block, thread level) all evaluators share
  interpreter.py  float64 / simulate / float32 modes, op -> numpy table; `run`, `run_field`
  scaled.py       running-max (online softmax) values for float32 mode
  storage.py      fp16 / bf16 storage rounding
  field.py        primes, residue pairs, exp as g^(a mod q), oracles, exact modular matmul
  semantics.py    op -> field definition over an abstract algebra (canonical forms)
  fieldrun.py     the walk with field semantics
  degree.py       per-tensor degree records for the Schwartz-Zippel bound
  equivalence.py  `check_equivalent` and the bound's derivation
  floatcheck.py   `float_check`, `adversarial_inputs`, the error limits
  reference64.py  fp64 evaluation of ONNX models for `mlso verify` (owned by the CLI)
"""

from __future__ import annotations

from mlso_cli.verify.equivalence import Verdict, check_equivalent
from mlso_cli.verify.field import BadPrime, Field, FieldArray, ZeroDenominator
from mlso_cli.verify.floatcheck import (
    LIMITS,
    FloatReport,
    adversarial_inputs,
    float_check,
    relative_error,
)
from mlso_cli.verify.interpreter import run, run_field

__all__ = [
    "LIMITS",
    "BadPrime",
    "Field",
    "FieldArray",
    "FloatReport",
    "Verdict",
    "ZeroDenominator",
    "adversarial_inputs",
    "check_equivalent",
    "float_check",
    "relative_error",
    "run",
    "run_field",
]
