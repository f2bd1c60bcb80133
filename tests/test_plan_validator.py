"""One table of crafted plans, two validators: runtime/plan.py and csrc/mlso_plan.h.

Why a shared table (tests/data/plan_cases.json): the packager and `mlso inspect` check plans in
Python, the op checks them again in C++ when ONNX Runtime creates the kernel, and a hostile model
can carry any plan. If the two disagree, a plan Python passes can still make the op write out of
bounds. Every case states the verdict and the rule (reason key) both sides must report. The C++
side runs in a small driver built with AddressSanitizer and UBSan, so a case that made the parser
read out of bounds fails the test even if the verdict were right.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mlso_cli.runtime import build
from mlso_cli.runtime.plan import PlanProblem, parse_plan, plan_json

TABLE = json.loads((Path(__file__).parent / "data" / "plan_cases.json").read_text())
CASES = {c["name"]: c for c in TABLE["cases"]}

DRIVER = r"""
#include <cstdio>
#include <fstream>
#include <sstream>
#include "mlso_plan.h"

static mlso::Declared declared(const mlso::json::Value& v) {
  mlso::Declared d;
  const mlso::json::Value& dtype = v.items.at(0);
  size_t itemsize = 0;
  if (dtype.kind == mlso::json::Value::String && !mlso::dtype_from_name(dtype.s, &d.dtype, &itemsize)) {
    d.dtype = -1;
  }
  const mlso::json::Value& dims = v.items.at(1);
  if (dims.kind == mlso::json::Value::Array) {
    d.has_shape = true;
    for (const auto& x : dims.items) d.dims.push_back(x.kind == mlso::json::Value::Null ? -1 : x.i);
  }
  return d;
}

int main(int argc, char** argv) {
  std::ifstream f(argv[1]);
  std::stringstream ss;
  ss << f.rdbuf();
  mlso::json::Value root;
  std::string err;
  if (!mlso::json::parse(ss.str(), &root, &err)) { std::fprintf(stderr, "%s\n", err.c_str()); return 2; }
  for (const auto& c : root.items) {
    std::vector<mlso::Declared> ins, outs;
    for (const auto& x : c.get("inputs")->items) ins.push_back(declared(x));
    for (const auto& x : c.get("outputs")->items) outs.push_back(declared(x));
    std::vector<std::string> kernels;
    for (const auto& k : c.get("kernels")->items) kernels.push_back(k.s);
    mlso::Plan plan;
    std::string msg, code = "ok";
    bool ok = mlso::parse_plan(c.get("text")->s, static_cast<long>(ins.size()),
                               static_cast<long>(outs.size()), &plan, &msg, &code) &&
              mlso::check_declared(plan, ins, outs, &msg, &code) &&
              mlso::check_kernels(plan, [&](const std::string& name) {
                for (const auto& k : kernels) if (k == name) return true;
                return false;
              }, &msg, &code);
    std::printf("%s\t%s\t%s\n", c.get("name")->s.c_str(), ok ? "ok" : code.c_str(), msg.c_str());
  }
  return 0;
}
"""


def _set(plan: dict[str, Any], path: str, value: Any) -> None:
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    target: Any = plan
    for k in keys[:-1]:
        target = target[k]
    target[keys[-1]] = value


def case_text(case: dict[str, Any]) -> str:
    """The plan attribute text a case stands for."""
    if "text" in case:
        return case["text"]
    plan = copy.deepcopy(TABLE["base"])
    for path, value in case.get("set", {}).items():
        _set(plan, path, value)
    text = plan_json(plan)
    if "text_truncate" in case:
        text = text[: case["text_truncate"]]
    text += case.get("text_append", "")
    if "text_replace" in case:
        old, new = case["text_replace"]
        assert old in text, case["name"]
        text = text.replace(old, new, 1)
    return text


def case_declared(case: dict[str, Any]) -> dict[str, list]:
    base = TABLE["base"]
    own = {
        "inputs": [[t["dtype"], t["shape"]] for t in base["inputs"]],
        "outputs": [[t["dtype"], t["shape"]] for t in base["outputs"]],
    }
    return case.get("declared", own)


def python_verdict(case: dict[str, Any]) -> tuple[str, str]:
    declared = case_declared(case)
    as_types = {k: [(d, s) for d, s in v] for k, v in declared.items()}
    try:
        parse_plan(
            case_text(case),
            len(declared["inputs"]),
            len(declared["outputs"]),
            declared_inputs=as_types["inputs"],
            declared_outputs=as_types["outputs"],
            kernels=case.get("kernels", TABLE["base_kernels"]),
        )
    except PlanProblem as e:
        return e.code, str(e)
    return "ok", ""


def test_the_table_is_large_and_covers_every_rule():
    assert len(CASES) >= 25
    assert sum(c["verdict"] == "ok" for c in CASES.values()) >= 8
    for c in CASES.values():
        assert (c["verdict"] == "ok") == (c["reason"] == "ok"), c["name"]
    reasons = {c["reason"] for c in CASES.values()}
    for rule in (
        "declared",
        "grid",
        "block",
        "smem",
        "scratch_total",
        "too_large",
        "ref",
        "kernel",
        "kernel_missing",
        "unknown_field",
        "json",
        "shape",
        "dtype",
    ):
        assert rule in reasons, rule


@pytest.mark.parametrize("name", sorted(CASES))
def test_python_validator(name):
    case = CASES[name]
    code, why = python_verdict(case)
    assert code == case["reason"], f"{name}: {why}"


@pytest.fixture(scope="module")
def cpp_verdicts(tmp_path_factory) -> dict[str, tuple[str, str]]:
    if not shutil.which("g++"):
        pytest.skip("g++ is needed for the C++ validator test")
    tmp = tmp_path_factory.mktemp("plan_validator")
    src = tmp / "driver.cc"
    src.write_text(DRIVER)
    exe = tmp / "driver"
    cmd = [
        "g++",
        "-std=c++17",
        "-g",
        "-O1",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
        "-fno-omit-frame-pointer",
        f"-I{build.CSRC}",
        str(src),
        "-o",
        str(exe),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = []
    for case in TABLE["cases"]:
        declared = case_declared(case)
        rows.append(
            {
                "name": case["name"],
                "text": case_text(case),
                **declared,
                "kernels": case.get("kernels", TABLE["base_kernels"]),
            }
        )
    data = tmp / "cases.json"
    data.write_text(json.dumps(rows))
    run = subprocess.run(
        [str(exe), str(data)],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0",
            "UBSAN_OPTIONS": "print_stacktrace=1",
            "PATH": "/usr/bin:/bin",
        },
    )
    assert run.returncode == 0 and not run.stderr, run.stderr[-4000:]
    out = {}
    for line in run.stdout.splitlines():
        name, code, msg = line.split("\t", 2)
        out[name] = (code, msg)
    assert set(out) == set(CASES)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpp_validator_agrees(cpp_verdicts, name):
    case = CASES[name]
    code, why = cpp_verdicts[name]
    assert code == case["reason"], f"{name}: {why}"
    assert code == python_verdict(case)[0]


def test_both_sides_name_the_field(cpp_verdicts):
    for name in ("output_float64", "output_shape_1"):
        py = python_verdict(CASES[name])[1]
        cc = cpp_verdicts[name][1]
        assert py == cc, (py, cc)
        assert py.startswith("outputs[0] is ") and "but the node declares float32 [2,256,64]" in py


def test_both_sides_word_library_gemm_problems_alike(cpp_verdicts):
    gemm = [n for n, c in CASES.items() if c["reason"] in ("gemm", "gemm_bounds")]
    assert len(gemm) >= 8
    for name in gemm:
        assert python_verdict(CASES[name])[1] == cpp_verdicts[name][1], name
