"""The typed public API: each op's signature as help() and inspect show it (every parameter
annotated, the annotations evaluated, a return type), a docstring that documents every
parameter, the Literal choices equal to what the ops' checks accept, and the package marked as
typed (py.typed). Static checking itself is mypy's (`mypy`, configured in pyproject.toml)."""

import dataclasses
import inspect
import pydoc
import re
import sys
import typing
from pathlib import Path

import pytest
import torch

import lmkernels
from lmkernels import types
from lmkernels.ops.flce import REDUCTIONS
from lmkernels.ops.glu import GELU_APPROXIMATIONS
from lmkernels.ops.rms_norm import CASTING_MODES
from lmkernels.ops.rope import LAYOUTS
from lmkernels.registry.core import Impl, ImplCapabilities, get_op
from lmkernels.registry.core import ops as registered_ops

# Every registered op's public function.
OPS = {spec.name: getattr(lmkernels, spec.name) for spec in registered_ops()}


def _documented(doc: str, name: str) -> bool:
    """Whether the docstring's Args section has an entry for `name` (Google style; entries may
    name several parameters: "device, dtype: ...")."""
    args = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
    return re.search(rf"^\s+(\w+, )*{re.escape(name)}(, \w+)*:", args, re.MULTILINE) is not None


def test_every_op_has_a_public_function():
    assert sorted(OPS) == sorted(s.name for s in lmkernels.ops())


@pytest.mark.parametrize("op", OPS)
def test_op_signature_is_annotated_and_evaluated(op):
    fn = OPS[op]
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    assert params[-1].name == "backend" and params[-1].kind is inspect.Parameter.KEYWORD_ONLY
    for p in params:
        assert p.annotation is not p.empty, f"{op}: {p.name} has no annotation"
        assert not isinstance(p.annotation, str), f"{op}: {p.name}'s annotation is not evaluated"
    assert sig.return_annotation is not sig.empty and not isinstance(sig.return_annotation, str)
    # typing.get_type_hints agrees with the signature (it reads the function's __annotations__)
    hints = typing.get_type_hints(fn)
    assert hints == {
        **{p.name: p.annotation for p in params},
        "return": sig.return_annotation,
    }
    # the tensors the op takes are annotated as tensors
    spec = get_op(op)
    for name in spec.grad_inputs:
        assert torch.Tensor in (hints[name], *typing.get_args(hints[name])), f"{op}: {name}"


@pytest.mark.parametrize("op", OPS)
def test_op_parameters_are_the_reference_parameters(op):
    """The public function declares what the eager reference (the op's definition) takes."""
    public = [p for p in inspect.signature(OPS[op]).parameters.values() if p.name != "backend"]
    reference = list(inspect.signature(get_op(op).reference).parameters.values())
    assert [(p.name, p.default) for p in public] == [(p.name, p.default) for p in reference]


@pytest.mark.parametrize("op", OPS)
def test_op_docstring_documents_every_parameter(op):
    fn = OPS[op]
    doc = inspect.getdoc(fn)
    assert doc and "Args:" in doc and "Returns:" in doc
    missing = [name for name in inspect.signature(fn).parameters if not _documented(doc, name)]
    assert not missing, f"{op}: the docstring does not document {missing}"
    # and help() shows both: the annotated signature and that docstring
    text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    assert f"{op}(" in text and "backend: str | None = None" in text
    assert "torch.Tensor" in text and doc.splitlines()[0] in text


def test_literal_choices_are_the_checked_choices():
    """The Literal of each string option is exactly what the op's checks accept."""
    pairs = [
        (types.CastingMode, CASTING_MODES, lmkernels.rms_norm, "casting_mode"),
        (types.RopeLayout, LAYOUTS, lmkernels.rope, "layout"),
        (types.GeluApproximation, GELU_APPROXIMATIONS, lmkernels.geglu, "approximate"),
        (types.Reduction, REDUCTIONS, lmkernels.fused_linear_cross_entropy, "reduction"),
    ]
    for alias, choices, fn, name in pairs:
        assert typing.get_args(alias) == choices
        assert typing.get_type_hints(fn)[name] == alias


@pytest.mark.skipif(sys.version_info < (3, 11), reason="typing.get_overloads is Python 3.11+")
def test_flce_overloads_follow_return_lse_and_return_stats():
    fn = lmkernels.fused_linear_cross_entropy
    overloads = typing.get_overloads(fn)
    returns = [typing.get_type_hints(o)["return"] for o in overloads]
    two = tuple[torch.Tensor, torch.Tensor]
    four = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    assert returns == [torch.Tensor, two, four, typing.get_type_hints(fn)["return"]]
    # each declares the implementation's parameters, with its defaults (or none: Literal[True])
    defaults = {p.name: p.default for p in inspect.signature(fn).parameters.values()}
    for o in overloads:
        params = inspect.signature(o).parameters.values()
        assert [p.name for p in params] == list(defaults)
        assert all(p.default is p.empty or p.default == defaults[p.name] for p in params)


def test_register_capabilities_are_the_impl_fields():
    fields = [f.name for f in dataclasses.fields(Impl)]
    assert fields[:3] == ["op", "backend", "fn"]
    assert list(ImplCapabilities.__annotations__) == fields[3:]


def test_package_is_marked_typed():
    """(test_wheel checks that the wheel ships it.)"""
    assert (Path(lmkernels.__file__).parent / "py.typed").is_file()
