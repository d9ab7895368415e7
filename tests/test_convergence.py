"""The convergence harness: a correct backend trains like transformers, a subtly wrong one does not.

CPU, fp32, the tiny Llama of lmkernels.convergence (2 layers, hidden 64, vocab 512), batches of
8 x 64 tokens of the shipped corpus. The tolerances are the harness's own (documented and
measured in lmkernels/convergence/compare.py); these tests check the verdicts it reaches.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="the convergence harness needs the hf extra")
pytest.importorskip("tokenizers", reason="the convergence harness needs the hf extra")

import lmkernels  # noqa: E402
from lmkernels.convergence import TOLERANCES_FP32, cli, data, run_convergence  # noqa: E402
from lmkernels.ops.rms_norm import rms_norm_reference  # noqa: E402
from lmkernels.registry import LMKernelsError, get_impl, unregister  # noqa: E402

STEPS = 30


def test_data_is_offline_deterministic_and_held_out():
    tok = data.tokenizer()
    assert tok.get_vocab_size() == data.DEFAULT_VOCAB_SIZE
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: lossless
    a = data.make_batches(3, 4, 16, seed=1)
    b = data.make_batches(3, 4, 16, seed=1)
    c = data.make_batches(3, 4, 16, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.train + a.eval, b.train + b.eval))
    assert not torch.equal(a.train[0], c.train[0])
    assert torch.equal(a.eval[0], c.eval[0])  # eval windows are fixed
    ids = data.token_ids()
    split = int(len(ids) * (1 - data.EVAL_FRACTION))
    assert torch.equal(a.eval[0][0], ids[split : split + 16])  # eval comes from the held-out tail
    with pytest.raises(LMKernelsError, match="^batch_size"):
        data.make_batches(3, 0, 16)


def test_compile_backend_converges_like_transformers():
    report = run_convergence("compile", families=("llama",), steps=STEPS)
    (case,) = report.cases
    assert case.ops == ("rms_norm", "rope", "mlp", "flce")
    failed = [f"{c.metric} {c.value:.3g} > {c.limit:.3g}" for c in case.checks if not c.passed]
    assert report.passed, failed
    baseline = report.families[0].baseline.losses
    assert baseline[0] - baseline[-1] > 0.8, "the run must really learn for the comparison to mean much"


@pytest.mark.skipif(
    get_impl("rms_norm", "triton").unavailable_reason() is not None,
    reason="triton backend unavailable here (needs triton and a GPU or TRITON_INTERPRET=1)",
)
def test_triton_backend_converges_like_transformers(triton_device):
    """Every Triton kernel (norm, rope, SwiGLU, FLCE) in training; under the CPU interpreter,
    so a smaller run: 6 steps of 2 x 16 tokens (the interpreter runs each Triton program in
    Python; 12 steps of 4 x 32 took 7 minutes). The fp32 limits only loosen with fewer steps."""
    report = run_convergence(
        "triton", families=("llama",), steps=6, batch_size=2, seq_len=16, device=triton_device
    )
    (case,) = report.cases
    failed = [f"{c.metric} {c.value:.3g} > {c.limit:.3g}" for c in case.checks if not c.passed]
    assert report.passed, failed
    baseline = report.families[0].baseline.losses
    assert baseline[-1] < baseline[0] - 0.02, "the weights must really move for the comparison to mean much"


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _rms_norm_with_x_grad_scaled(scale):
    """The eager rms_norm, except that its gradient for x is `scale` times the true one."""

    def rms_norm(x, weight=None, eps=1e-6, offset=0.0, casting_mode="llama"):
        return rms_norm_reference(_ScaleGrad.apply(x, scale), weight, eps, offset, casting_mode)

    return rms_norm


@pytest.fixture
def toy_backends():
    """'toy_exact' (scale 1, a correct copy of eager) and 'toy_broken' (x-gradient 2% too large),
    implementing rms_norm only; removed afterwards."""
    lmkernels.register("rms_norm", "toy_exact", _rms_norm_with_x_grad_scaled(1.0), priority=-100)
    lmkernels.register("rms_norm", "toy_broken", _rms_norm_with_x_grad_scaled(1.02), priority=-100)
    yield
    unregister("rms_norm", "toy_exact")
    unregister("rms_norm", "toy_broken")
    assert "toy_broken" not in lmkernels.backend_names()


def test_subtly_broken_backend_passes_a_loose_op_check_but_fails_convergence(toy_backends):
    # 1. A naive single-tensor check passes: identical forward, gradients within 5%.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g, requires_grad=True)
    w = (torch.randn(96, generator=g) * 0.5 + 1).requires_grad_()
    dy = torch.randn(37, 96, generator=g)
    grads = {}
    for backend in ("eager", "toy_broken"):
        y = lmkernels.rms_norm(x, w, backend=backend)
        grads[backend] = torch.autograd.grad(y, (x, w), dy)
        if backend == "toy_broken":
            assert torch.equal(y, lmkernels.rms_norm(x, w, backend="eager"))
    rel = [((b - e).norm() / e.norm()).item() for e, b in zip(grads["eager"], grads["toy_broken"])]
    assert rel[0] == pytest.approx(0.02, rel=1e-5) and rel[1] == 0.0
    assert max(rel) < 0.05  # what a loose per-op check would accept

    # 2. The convergence comparison flags it; an exact copy of the same code path passes, so the
    #    failure is the 2%, not the toy backend implementing rms_norm only.
    exact = run_convergence("toy_exact", families=("llama",), steps=STEPS)
    broken = run_convergence("toy_broken", families=("llama",), steps=STEPS)
    assert exact.passed and exact.cases[0].ops == ("rms_norm",)
    assert "not patched: rope" in exact.cases[0].notes
    assert not broken.passed
    checks = {c.metric: c for c in broken.cases[0].checks}
    # Every metric that sees the training trajectory flags it, by a wide margin.
    for metric in ("loss curve", "top-k log-probs", "params"):
        assert checks[metric].value > 5 * TOLERANCES_FP32[metric], (metric, checks[metric].value)


def test_ablation_and_bf16_relative_criterion():
    """Ablation runs every variant; 'none' equals the baseline bit for bit (the runs are
    deterministic). bf16 is judged against the fp32 run, relative to plain transformers' bf16."""
    report = run_convergence("eager", families=("gemma2",), steps=8, ablation=True)
    variants = {c.variant: c for c in report.cases}
    assert list(variants) == ["all", "no-flce", "none"]
    assert variants["no-flce"].ops == ("rms_norm", "rope", "mlp")
    assert all(c.value == 0.0 for c in variants["none"].checks)
    assert report.passed

    bf16 = run_convergence("eager", families=("llama",), steps=8, dtype="bf16")
    fam = bf16.families[0]
    assert fam.reference is not None and fam.reference.dtype == "fp32"
    assert bf16.passed, [(c.metric, c.value, c.limit) for c in bf16.cases[0].checks]


def test_cli_exit_codes_and_outputs(tmp_path, toy_backends):
    args = [
        "converge",
        "--family",
        "llama",
        "--steps",
        str(STEPS),
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    assert cli.main([*args, "--backend", "toy_exact"]) == 0
    assert cli.main([*args, "--backend", "toy_broken"]) == 1
    result = json.loads((tmp_path / "converge-llama-toy_broken-fp32.json").read_text())
    assert result["passed"] is False
    failed = {c["metric"] for c in result["families"][0]["cases"][0]["checks"] if not c["passed"]}
    assert {"loss curve", "params"} <= failed
    png = tmp_path / "converge-llama-toy_broken-fp32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for bad in ([*args, "--backend", "no_such_backend"], ["converge", "--family", "gpt2"]):
        with pytest.raises(SystemExit) as exit_info:  # argparse rejects a bad backend or family
            cli.main(bad)
        assert exit_info.value.code == 2
