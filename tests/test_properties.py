"""Property-based tests, driven by the registry: every op's random valid cases (OpSpec.sample)
with random dtypes and memory layouts, through every backend of ours, judged by
harness/properties.py (the correctness policy against fp64, inputs untouched, only
lmkernels' errors, double backward correct or refused; torch.func.jvp, forward_ad, grad and
vmap correct or refused by name). A backend or op registered later is covered with no edits here.

Profiles (LMKERNELS_HYPOTHESIS_PROFILE): "ci" (the default: a fixed, bounded number of
examples per op and backend, derandomized so that CI is repeatable; a few minutes on one
CPU core: the file runs on one pytest worker) and "long" (500 random examples each, on demand). A case hypothesis finds failing is
printed as a `Case(...)`; it goes into tests/property_regressions.py, which replays them all.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from conftest import DEVICE
from lmkernels.harness.checks import DTYPE_NAMES
from lmkernels.harness.properties import (
    CORRUPTIONS,
    Case,
    check_bad_input,
    check_double_backward,
    check_forward_ad,
    check_func_grad,
    check_sample,
    check_vmap,
    layouts_for,
)
from lmkernels.registry.core import impls, ops
from property_regressions import REGRESSIONS

PROFILE = os.environ.get("LMKERNELS_HYPOTHESIS_PROFILE", "ci")
_COMMON = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("ci", derandomize=True, database=None, **_COMMON)
settings.register_profile("long", **_COMMON)

# Examples per (op, backend) in the "ci" profile. The compile backend compiles a new graph for
# most new dtypes, ranks and option sets (an inductor C++ build each on the CPU): fewer there.
CI_EXAMPLES = {"compile": 4}
CI_DEFAULT = 15
LONG_EXAMPLES = 500
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _examples(backend: str) -> int:
    if PROFILE == "long":
        return LONG_EXAMPLES
    return CI_EXAMPLES.get(backend, CI_DEFAULT)


class Draw:
    """OpSpec.sample's chooser, backed by hypothesis."""

    def __init__(self, data):
        self.data = data

    def integers(self, lo, hi):
        return self.data.draw(st.integers(lo, hi))

    def sampled_from(self, seq):
        return self.data.draw(st.sampled_from(seq))

    def booleans(self):
        return self.data.draw(st.booleans())


def _ours():
    for spec in ops():
        if spec.sample is None:
            continue
        for impl in impls(spec.name):
            if not impl.external:
                yield pytest.param(spec, impl, id=f"{spec.name}-{impl.backend}")


def _skip_unavailable(impl):
    reason = impl.unavailable_reason()
    if reason:
        pytest.skip(f"{impl.backend} unavailable here: {reason}")
    if DEVICE not in impl.devices:
        pytest.skip(f"{impl.backend} does not run on {DEVICE}")


# Examples of the compile backend between two resets of dynamo: each compiles at most a few graphs
# per code object, so that stays under the recompile limit (64, backends/compile.py).
EXAMPLES_PER_RESET = 16


def _room_to_compile(impl, examples: list[int]) -> None:
    """For the compile backend, forget dynamo's graphs every EXAMPLES_PER_RESET examples of one
    test: the long profile draws more graph variants of one op (dtype x layout x rank x option
    set) than dynamo's recompile limit keeps for a code object, past which the tests make it an
    error (conftest.py). examples: the test's count so far (one element, updated)."""
    if impl.backend != "compile":
        return
    examples[0] += 1
    if examples[0] % EXAMPLES_PER_RESET == 0:
        torch._dynamo.reset()


def _draw_case(data, spec, impl) -> Case:
    draw = Draw(data)
    shape, options = spec.sample(draw)
    dtype = draw.sampled_from(DTYPES)
    inputs = spec.make_inputs(shape, dtype, "cpu", 0, **options)
    layouts = {
        name: draw.sampled_from(layouts_for(t, spec.sample_layouts.get(name)))
        for name, t in sorted(inputs.items())
        if isinstance(t, torch.Tensor)
    }
    case = Case(spec.name, impl.backend, shape, options, DTYPE_NAMES[dtype], layouts, draw.integers(0, 2**16))
    note(repr(case))
    return case


@pytest.mark.parametrize(("spec", "impl"), list(_ours()))
def test_matches_fp64_and_leaves_inputs_alone(spec, impl):
    _skip_unavailable(impl)

    examples = [0]

    @settings(settings.get_profile(PROFILE), max_examples=_examples(impl.backend))
    @given(data=st.data())
    def prop(data):
        case = _draw_case(data, spec, impl)
        _room_to_compile(impl, examples)
        result = check_sample(spec, impl, case, DEVICE)
        assert result.status != "fail", f"{case}\n{result.reason}"

    prop()


@pytest.mark.parametrize(("spec", "impl"), list(_ours()))
def test_bad_inputs_raise_lmkernels_errors_naming_them(spec, impl):
    _skip_unavailable(impl)

    examples = [0]

    @settings(settings.get_profile(PROFILE), max_examples=_examples(impl.backend))
    @given(data=st.data())
    def prop(data):
        case = _draw_case(data, spec, impl)
        _room_to_compile(impl, examples)
        inputs = spec.make_inputs(case.shape, torch.float32, "cpu", 0, **case.options)
        names = sorted(k for k, v in inputs.items() if isinstance(v, torch.Tensor))
        name = data.draw(st.sampled_from(names))
        corruption = data.draw(st.sampled_from(CORRUPTIONS))
        result = check_bad_input(spec, impl, case, name, corruption, DEVICE)
        assert result.status == "pass", f"{case}, {corruption} of {name}: {result.reason}"

    prop()


@pytest.mark.parametrize(("spec", "impl"), list(_ours()))
def test_double_backward_is_right_or_refused(spec, impl):
    _skip_unavailable(impl)
    result = check_double_backward(spec, impl, DEVICE)
    assert result.status == "pass", result.reason


@pytest.mark.parametrize(("spec", "impl"), list(_ours()))
def test_forward_ad_is_right_or_refused(spec, impl):
    _skip_unavailable(impl)
    result = check_forward_ad(spec, impl, DEVICE)
    assert result.status == "pass", result.reason


@pytest.mark.parametrize(("spec", "impl"), list(_ours()))
def test_func_grad_matches_the_plain_gradient(spec, impl):
    _skip_unavailable(impl)
    result = check_func_grad(spec, impl, DEVICE)
    assert result.status == "pass", result.reason


@pytest.mark.parametrize(("spec", "impl"), list(_ours()))
def test_vmap_matches_a_loop_or_is_refused(spec, impl):
    _skip_unavailable(impl)
    result = check_vmap(spec, impl, DEVICE)
    assert result.status == "pass", result.reason


def _regressions():
    by_name = {(i.op, i.backend): (s, i) for s in ops() for i in impls(s.name)}
    for n, case in enumerate(REGRESSIONS):
        spec, impl = by_name[(case.op, case.backend)]
        yield pytest.param(spec, impl, case, id=f"{n}-{case.op}-{case.backend}")


@pytest.mark.parametrize(("spec", "impl", "case"), list(_regressions()))
def test_regressions(spec, impl, case):
    """The cases hypothesis once found failing (tests/property_regressions.py)."""
    _skip_unavailable(impl)
    result = check_sample(spec, impl, case, DEVICE)
    assert result.status != "fail", result.reason
