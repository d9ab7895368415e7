"""fused_linear_distillation (ops/distill.py, backends/triton/distill.py) against an fp64 TRL-style
generalized JSD written out here (and TRL's own, where it is installed): each divergence, beta
0 / 0.5 / 1, temperature, ignore_index, the hard loss; gradients against fp64 autograd; the
Triton backend's chunks (several per call, none of tokens x V), its refusals and its
torch.library registration. The registry-driven suites (test_correctness, test_properties,
test_error_inputs) cover the grid and random cases."""

import gc
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import lmkernels
from conftest import DEVICE
from lmkernels import BackendNotSupportedError, ConsumedInputsError
from lmkernels.harness.checks import rel_rms_error
from lmkernels.ops.distill import SPEC, DistillOptions

try:
    from lmkernels.backends.triton import distill as triton_distill
except ImportError:  # no triton: the eager and compile tests still run
    triton_distill = None
TRITON_OK = (
    triton_distill is not None and lmkernels.get_impl(SPEC.name, "triton").unavailable_reason() is None
)
CHUNK_ENV = "LMKERNELS_DISTILL_CHUNK_TOKENS"  # the Triton backend's tokens per chunk
# compile is the compiled reference: each new option set is an inductor build (seconds on the
# CPU), so it runs the tests where a few option sets are enough.
BACKENDS = ["eager", "triton"] if TRITON_OK else ["eager"]
GRADS = ("student_hidden", "student_weight", "student_bias")
SHAPE = {"BT": 37, "Hs": 16, "Ht": 24, "V": 131}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """8 tokens per Triton chunk unless a test says otherwise: BT=37 runs 8+8+8+8+5."""
    monkeypatch.setenv(CHUNK_ENV, "8")


def trl_style_loss(xs, xt, target, beta, temperature, hard_weight=0.0, soft_weight=1.0, reduction="mean"):
    """The generalized JSD of TRL's GKDTrainer.generalized_jsd_loss (beta 0: KL(teacher ||
    student), beta 1: KL(student || teacher), else the two KLs to the mixture (1 - beta) p_s +
    beta p_t), in torch's kl_div terms, plus the hard cross entropy; logits (BT, V)."""
    log_s = F.log_softmax(xs / temperature, -1)
    log_t = F.log_softmax(xt / temperature, -1)
    if beta == 0:
        per_token = F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        per_token = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    else:
        b = torch.tensor(beta, dtype=xs.dtype)
        log_m = torch.logsumexp(torch.stack([log_s + torch.log1p(-b), log_t + torch.log(b)]), 0)
        kl_t = F.kl_div(log_m, log_t, reduction="none", log_target=True).sum(-1)
        kl_s = F.kl_div(log_m, log_s, reduction="none", log_target=True).sum(-1)
        per_token = beta * kl_t + (1 - beta) * kl_s
    per_token = soft_weight * per_token
    if target is None:
        mask = torch.ones(xs.shape[0], dtype=torch.bool)
    else:
        mask = target != -100
        if hard_weight:
            ce = F.cross_entropy(xs, target, ignore_index=-100, reduction="none")
            per_token = per_token + hard_weight * ce
    per_token = torch.where(mask, per_token, 0.0)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / mask.sum().clamp_min(1)


def make(case, dtype=torch.float32, shape=SHAPE, seed=0):
    return SPEC.make_inputs(shape, dtype, DEVICE, seed, **case)


def run(inputs, backend, upstream=None):
    """(loss, {name: gradient}) of one call with the student's tensors requiring grad."""
    inputs = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    leaves = {n: inputs[n].requires_grad_(True) for n in GRADS if inputs.get(n) is not None}
    loss = lmkernels.fused_linear_distillation(**inputs, backend=backend)
    up = torch.ones_like(loss) if upstream is None else upstream.to(loss.device)
    grads = torch.autograd.grad(loss, list(leaves.values()), up)
    return loss.detach(), dict(zip(leaves, grads))


def fp64_truth(inputs, upstream=None):
    """The TRL-style loss and its gradients in fp64 on the same input values."""
    o = {**{f.name: f.default for f in DistillOptions.__dataclass_fields__.values()}, **inputs}
    d = {
        k: v.detach().cpu().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in o.items()
    }
    leaves = {n: d[n].requires_grad_(True) for n in GRADS if d.get(n) is not None}
    xs = F.linear(
        d["student_hidden"].reshape(-1, d["student_weight"].shape[1]), d["student_weight"], d["student_bias"]
    )
    xt = F.linear(
        d["teacher_hidden"].reshape(-1, d["teacher_weight"].shape[1]), d["teacher_weight"], d["teacher_bias"]
    )
    target = o.get("target")
    target = None if target is None else target.cpu().reshape(-1)
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(o["divergence"], o["beta"])
    loss = trl_style_loss(
        xs, xt, target, beta, o["temperature"], o["hard_weight"], o["soft_weight"], o["reduction"]
    )
    up = torch.ones_like(loss) if upstream is None else upstream.double()
    grads = torch.autograd.grad(loss, list(leaves.values()), up)
    return loss.detach(), dict(zip(leaves, grads))


def assert_matches_fp64(inputs, backend, bound=2e-6, upstream=None):
    loss, grads = run(inputs, backend, upstream)
    ref_loss, ref_grads = fp64_truth(inputs, upstream)
    assert rel_rms_error(loss.cpu(), ref_loss) <= bound, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert rel_rms_error(grads[name].cpu(), ref_grads[name]) <= bound * 4, name


FP64_CASES = [
    {"beta": 0.5},
    {"beta": 0.0},
    {"beta": 1.0},
    {"beta": 0.2, "temperature": 2.0},
    {"divergence": "forward_kl", "temperature": 0.5},
    {"divergence": "reverse_kl", "temperature": 3.0},
    {"hard_weight": 0.7, "soft_weight": 0.3, "temperature": 2.0},
    {"divergence": "reverse_kl", "hard_weight": 1.0},
    {"with_target": False, "reduction": "sum"},
    {"reduction": "none", "with_bias": True, "ignore_fraction": 0.5},
]


def _fp64_params():
    for i, case in enumerate(FP64_CASES):
        for backend in [*BACKENDS, *(["compile"] if i in (0, 6, 9) else [])]:
            yield pytest.param(
                backend, case, id=f"{backend}-" + ",".join(f"{k}={v}" for k, v in case.items())
            )


@pytest.mark.parametrize(("backend", "case"), list(_fp64_params()))
def test_matches_trl_style_fp64(backend, case):
    """fp32 values and gradients within a few fp32 roundings of the fp64 truth: the semantics
    are TRL's (a wrong beta convention, temperature or mask is O(1) off)."""
    upstream = None
    if case.get("reduction") == "none":
        upstream = torch.randn(SHAPE["BT"], generator=torch.Generator().manual_seed(1))
    assert_matches_fp64(make(case), backend, upstream=upstream)


def test_jsd_limits_are_the_kls():
    """TRL's special cases, not the formula's limits (which are 0): jsd with beta 0 is the
    forward KL, with beta 1 the reverse KL; near them the JSD is small."""
    inputs = make({})
    kl = {
        d: lmkernels.fused_linear_distillation(**inputs, divergence=d, backend="eager")
        for d in ("forward_kl", "reverse_kl")
    }
    assert lmkernels.fused_linear_distillation(**inputs, beta=0.0, backend="eager") == kl["forward_kl"]
    assert lmkernels.fused_linear_distillation(**inputs, beta=1.0, backend="eager") == kl["reverse_kl"]
    near = lmkernels.fused_linear_distillation(**inputs, beta=1e-4, backend="eager")
    assert 0 < near < 1e-2 * kl["forward_kl"]


def test_matches_trl_itself():
    """The same numbers as TRL's own GKDTrainer.generalized_jsd_loss (labels given: batchmean over
    the labelled tokens) for beta 0, 0.5, 1 and a temperature."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    inputs = make({"with_bias": True})
    xs = F.linear(inputs["student_hidden"], inputs["student_weight"], inputs["student_bias"]).cpu()
    xt = F.linear(inputs["teacher_hidden"], inputs["teacher_weight"], inputs["teacher_bias"]).cpu()
    for beta in (0.0, 0.5, 1.0):
        for temperature in (1.0, 2.0):
            trl = gkd.GKDTrainer.generalized_jsd_loss(
                xs[None], xt[None], inputs["target"].cpu()[None], beta=beta, temperature=temperature
            )
            for backend in BACKENDS:
                ours = lmkernels.fused_linear_distillation(
                    **inputs, beta=beta, temperature=temperature, backend=backend
                )
                torch.testing.assert_close(ours.cpu(), trl, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_tokens_count_for_nothing(backend):
    """Ignored tokens: loss 0, no gradient, and outside the mean's denominator; changing their
    hidden states changes nothing."""
    inputs = make({"reduction": "none", "hard_weight": 0.5, "ignore_fraction": 0.4})
    ignored = inputs["target"] == -100
    assert 0 < int(ignored.sum()) < SHAPE["BT"]
    loss, grads = run(inputs, backend, torch.randn(SHAPE["BT"]))
    assert (loss[ignored] == 0).all() and (loss[~ignored] > 0).all()
    assert (grads["student_hidden"][ignored] == 0).all()
    mean = lmkernels.fused_linear_distillation(**{**inputs, "reduction": "mean"}, backend=backend)
    torch.testing.assert_close(mean, loss.sum() / (~ignored).sum(), rtol=1e-5, atol=0)
    moved = dict(inputs, student_hidden=inputs["student_hidden"].clone())
    moved["student_hidden"][ignored] += 3.0
    torch.testing.assert_close(lmkernels.fused_linear_distillation(**moved, backend=backend), loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_mean_is_zero(backend):
    inputs = make({"ignore_fraction": 1.0, "hard_weight": 1.0})
    loss, grads = run(inputs, backend)
    assert loss.item() == 0.0 and all((g == 0).all() for g in grads.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_are_kept(backend):
    """(B, T, H) hidden states: reduction "none" gives (B, T), the same values as flat tokens."""
    flat = make({"reduction": "none", "with_bias": True})
    shaped = dict(flat)
    for name in ("student_hidden", "teacher_hidden"):
        shaped[name] = flat[name][:36].reshape(4, 9, -1)
    shaped["target"] = flat["target"][:36].reshape(4, 9)
    out = lmkernels.fused_linear_distillation(**shaped, backend=backend)
    assert out.shape == (4, 9) and out.dtype == torch.float32
    torch.testing.assert_close(
        out.reshape(-1), lmkernels.fused_linear_distillation(**flat, backend=backend)[:36]
    )


@pytest.mark.skipif(not TRITON_OK, reason="the Triton backend is unavailable here")
class TestTriton:
    @pytest.mark.parametrize("chunk", ["1", "5", "37", "4096"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    def test_chunk_sizes(self, monkeypatch, chunk, dtype):
        """One token per chunk, uneven chunks, one chunk: the same results (bf16: more than 8
        chunks sum grad_W in an fp32 accumulator, fewer in bf16), within the policy against
        fp64 the harness applies."""
        from lmkernels.harness.checks import check_case

        monkeypatch.setenv(CHUNK_ENV, chunk)
        case = {"beta": 0.3, "hard_weight": 0.5, "with_bias": True, "temperature": 1.5}
        result = check_case(SPEC, lmkernels.get_impl(SPEC.name, "triton"), SHAPE, dtype, case, device=DEVICE)
        assert result.status == "pass", result.reason

    def test_no_tokens_by_vocabulary_buffer(self, monkeypatch):
        """A training step allocates nothing of tokens x V elements (the chunks are 8 tokens):
        every allocation is at most a chunk's logits, a gradient, or smaller. The eager reference,
        run the same way, does allocate tokens x V (the check sees such buffers)."""
        if DEVICE == "cuda":
            pytest.skip("torch.profiler does not attribute CUDA caching-allocator allocations")
        shape = {"BT": 256, "Hs": 8, "Ht": 8, "V": 257}
        inputs = make({"with_bias": True}, shape=shape)
        full = shape["BT"] * shape["V"] * 4  # one fp32 tokens x V buffer
        largest = {b: max(self._allocations(inputs, b)) for b in ("triton", "eager")}
        assert largest["eager"] >= full
        assert largest["triton"] <= 8 * shape["V"] * 4 < full // 16, largest

    @staticmethod
    def _allocations(inputs, backend):
        inputs = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        for name in GRADS:
            inputs[name].requires_grad_(True)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            lmkernels.fused_linear_distillation(**inputs, backend=backend).backward()
            gc.collect()
        return [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]

    def test_teacher_gradient_is_refused_and_eager_gives_it(self):
        """A teacher tensor requiring grad: the Triton backend refuses it by name (never a
        silently missing gradient); eager differentiates it as plain PyTorch."""
        inputs = make({"with_bias": True})
        inputs["teacher_weight"].requires_grad_(True)
        with pytest.raises(BackendNotSupportedError, match="teacher_weight requires grad"):
            lmkernels.fused_linear_distillation(**inputs, backend="triton")
        with torch.no_grad():  # no gradient wanted: it runs
            lmkernels.fused_linear_distillation(**inputs, backend="triton")
        loss = lmkernels.fused_linear_distillation(**inputs, backend="eager")
        (grad,) = torch.autograd.grad(loss, [inputs["teacher_weight"]])
        d = {
            k: v.detach().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs.items()
        }
        tw = d["teacher_weight"].requires_grad_(True)
        xs = F.linear(d["student_hidden"], d["student_weight"], d["student_bias"])
        xt = F.linear(d["teacher_hidden"], tw, d["teacher_bias"])
        (ref,) = torch.autograd.grad(trl_style_loss(xs, xt, d["target"], 0.5, 1.0), [tw])
        assert rel_rms_error(grad, ref) < 1e-5

    def test_teacher_in_another_dtype(self):
        """A bf16 teacher beside an fp32 student (teacher logits rounded to bf16 as its model
        rounds them): the same as eager."""
        inputs = make({"divergence": "forward_kl", "temperature": 2.0})
        for name in ("teacher_hidden", "teacher_weight"):
            inputs[name] = inputs[name].bfloat16()
        loss, grads = run(inputs, "triton")
        ref_loss, ref_grads = run(inputs, "eager")
        # The Triton teacher logits stay in fp32 (eager's are rounded to bf16): close, not equal.
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
        for name in grads:
            assert rel_rms_error(grads[name], ref_grads[name]) < 2e-2

    def test_second_backward(self):
        """mean/sum: the gradients computed in the forward were handed over by the first
        backward, so a second one raises; "none" recomputes and can run twice."""
        inputs = make({})
        h = inputs["student_hidden"].requires_grad_(True)
        loss = lmkernels.fused_linear_distillation(**inputs, backend="triton")
        loss.backward(retain_graph=True)
        with pytest.raises(ConsumedInputsError, match="second backward"):
            loss.backward()
        h.grad = None
        per_token = lmkernels.fused_linear_distillation(**inputs, reduction="none", backend="triton")
        per_token.sum().backward(retain_graph=True)
        first = h.grad.clone()
        per_token.sum().backward()
        torch.testing.assert_close(h.grad, 2 * first)

    def test_upstream_gradient_scales(self):
        inputs = make({"reduction": "sum", "with_bias": True})
        assert_matches_fp64(inputs, "triton", upstream=torch.tensor(-0.37))

    def test_unchecked_out_of_range_target_gives_nan(self, monkeypatch):
        monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")
        inputs = make({"reduction": "none"}, shape={"BT": 6, "Hs": 8, "Ht": 4, "V": 11})
        inputs["target"] = torch.tensor([0, 1, 11, 3, -5, -100], device=DEVICE)
        for backend in BACKENDS:
            loss = lmkernels.fused_linear_distillation(**inputs, backend=backend)
            assert loss[[2, 4]].isnan().all() and loss[[0, 1, 3]].isfinite().all(), backend
            assert loss[5].item() == 0.0

    @pytest.mark.parametrize("reduction", ["mean", "none"])
    def test_opcheck(self, reduction):
        """The forward and backward custom ops' schemas, fake and autograd registrations."""
        inputs = make({"with_bias": True, "hard_weight": 0.5}, shape={"BT": 12, "Hs": 8, "Ht": 4, "V": 40})
        for name in GRADS:
            inputs[name].requires_grad_(True)
        o = DistillOptions(
            inputs["student_bias"], inputs["teacher_bias"], "jsd", 0.5, 2.0, -100, 0.5, 1.0, reduction
        )
        args = (
            inputs["student_hidden"], inputs["student_weight"], inputs["teacher_hidden"], inputs["teacher_weight"],
            inputs["target"], o.student_bias, o.teacher_bias, o.divergence, o.beta, o.temperature, o.ignore_index,
            o.hard_weight, o.soft_weight, o.reduction,
        )  # fmt: skip
        torch.library.opcheck(
            torch.ops.lmkernels.distill_triton_forward.default, (*args, True, True, True, 5)
        )
        grad = torch.randn((12,) if reduction == "none" else (), device=DEVICE)
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(
            torch.ops.lmkernels.distill_triton_backward.default, (grad, *detached, True, True, True, 5)
        )

    @pytest.mark.parametrize("reduction", ["mean", "none"])
    def test_compile_fullgraph_matches_eager_call(self, reduction):
        torch._dynamo.reset()
        inputs = make({"reduction": reduction, "with_bias": True, "divergence": "reverse_kl"})

        def fn(**i):
            return lmkernels.fused_linear_distillation(**i, backend="triton")

        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        up = torch.randn(SHAPE["BT"], device=DEVICE) if reduction == "none" else None
        loss, grads = run_fn(fn, inputs, up)
        c_loss, c_grads = run_fn(compiled, inputs, up)
        torch.testing.assert_close(c_loss, loss, rtol=0, atol=0)
        for name in grads:
            torch.testing.assert_close(c_grads[name], grads[name], rtol=0, atol=0)

    @pytest.mark.skipif(DEVICE != "cuda", reason="CUDA's sync debug mode: a GPU test")
    @pytest.mark.parametrize("reduction", ["mean", "none"])
    def test_no_host_sync(self, monkeypatch, reduction):
        """Forward and backward never wait for the GPU on the host (torch's sync debug mode raises
        at any synchronizing call) with the target check (its one sync) off; 9 chunks of bf16
        sum grad_W in the fp32 accumulator."""
        monkeypatch.setenv("LMKERNELS_CHECK_VALUES", "0")
        shape = {"BT": 1100, "Hs": 256, "Ht": 128, "V": 32000}
        monkeypatch.setenv(CHUNK_ENV, "128")
        inputs = make({"reduction": reduction, "hard_weight": 0.5, "with_bias": True}, torch.bfloat16, shape)
        for name in GRADS:
            inputs[name].requires_grad_(True)
        lmkernels.fused_linear_distillation(**inputs, backend="triton").sum().backward()  # compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            lmkernels.fused_linear_distillation(**inputs, backend="triton").sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def test_chunk_tokens_rule(self, monkeypatch):
        monkeypatch.delenv(CHUNK_ENV)
        V = 128256
        tokens = triton_distill.chunk_tokens(8192, V)
        assert tokens % 128 == 0 and tokens * V * 8 <= triton_distill.CHUNK_BYTES < (tokens + 128) * V * 8
        assert triton_distill.chunk_tokens(5, V) == 5
        assert triton_distill.chunk_tokens(10_000, 2**24) == 128  # the floor, past the byte cap

    @pytest.mark.skipif(DEVICE != "cuda", reason="peak GPU memory: a GPU test")
    def test_bf16_sum_chunks_peak_below_the_accumulators(self, monkeypatch):
        """Measured, not modelled: at 4608 tokens x V 262144 x H 1024 (bf16) the byte cap's
        chunks (512 tokens) are 9 and need grad_W's fp32 accumulator; chunk_tokens takes 8 of
        640 summed in bf16, whose training step peaks lower above its inputs."""
        shape = {"BT": 4608, "Hs": 1024, "Ht": 1024, "V": 262144}
        monkeypatch.delenv(CHUNK_ENV)
        assert triton_distill.chunk_tokens(4608, 262144, 1024, False) == 512
        assert triton_distill.chunk_tokens(4608, 262144, 1024, True) == 640
        inputs = make({"reduction": "mean"}, torch.bfloat16, shape)
        for name in ("student_hidden", "student_weight"):
            inputs[name].requires_grad_(True)
        peaks = {}
        for chunk in ("512", None):
            if chunk:
                monkeypatch.setenv(CHUNK_ENV, chunk)
            else:
                monkeypatch.delenv(CHUNK_ENV)
            for name in ("student_hidden", "student_weight"):
                inputs[name].grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            lmkernels.fused_linear_distillation(**inputs, backend="triton").backward()
            torch.cuda.synchronize()
            peaks[chunk] = torch.cuda.max_memory_allocated() - base
        assert peaks[None] < peaks["512"], peaks

    def test_chunk_tokens_take_bf16_sums_when_they_cost_no_memory(self, monkeypatch):
        """With a bf16 weight gradient, chunks few enough for grad_W to sum in bf16 (at most
        MAX_SUPER_CHUNKS) replace the byte cap's where the peak (both fp32 chunk buffers plus
        grad_W's buffer: fp32 past MAX_SUPER_CHUNKS chunks) does not rise; a plan that would
        need more memory keeps the cap's chunks."""
        monkeypatch.delenv(CHUNK_ENV)
        most = triton_distill.MAX_SUPER_CHUNKS

        def peak(BT, V, H, tokens):
            chunks = -(-BT // tokens)
            return 8 * V * min(tokens, BT) + (4 if chunks > most else 2) * V * H

        # 8192 tokens, student 1536 x 151936: 11 chunks of 768 with an fp32 accumulator, or 8 of
        # 1024 summed in bf16 at 148 MiB less.
        assert triton_distill.chunk_tokens(8192, 151936, 1536, False) == 768
        assert triton_distill.chunk_tokens(8192, 151936, 1536, True) == 1024
        for BT in (100, 4096, 8192, 9000, 16384, 65536):
            for V in (32000, 128256, 151936, 262144):
                for H in (64, 1536, 4096, 8192):
                    cap = triton_distill.chunk_tokens(BT, V, H, False)
                    tokens = triton_distill.chunk_tokens(BT, V, H, True)
                    assert peak(BT, V, H, tokens) <= peak(BT, V, H, cap), (BT, V, H)
                    if tokens != cap:
                        assert -(-BT // tokens) <= most and tokens % 128 == 0, (BT, V, H, tokens)


def run_fn(fn, inputs, upstream):
    inputs = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    leaves = {n: inputs[n].requires_grad_(True) for n in GRADS if inputs.get(n) is not None}
    loss = fn(**inputs)
    grads = torch.autograd.grad(
        loss, list(leaves.values()), torch.ones_like(loss) if upstream is None else upstream
    )
    return loss.detach(), dict(zip(leaves, grads))


def test_options_are_defined_once():
    """DistillOptions is the op's option set: the public function and the reference spell it out
    with its names, order and defaults (after the four inputs and the target); the backends read
    DistillOptions(**options), so an unknown option names itself."""
    fields = {name: f.default for name, f in DistillOptions.__dataclass_fields__.items()}
    inputs = ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")
    for fn in (lmkernels.fused_linear_distillation, SPEC.reference):
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[:5]] == [*inputs, "target"] and params[4].default is None
        options = {p.name: p.default for p in params[5:] if p.name != "backend"}
        assert list(options.items()) == list(fields.items()), fn
    if TRITON_OK:
        small = make({}, shape={"BT": 2, "Hs": 3, "Ht": 3, "V": 5})
        with pytest.raises(TypeError, match="'temprature'"):
            lmkernels.get_impl(SPEC.name, "triton").fn(**small, temprature=2.0)


def test_log_space_mixture_has_no_underflow():
    """Probabilities far below fp32's range in both models (logit gaps of 200) leave the JSD
    finite in every backend: the mixture is taken in log space."""
    inputs = make({}, shape={"BT": 3, "Hs": 4, "Ht": 4, "V": 7})
    inputs["student_weight"] = inputs["student_weight"] * 60.0
    inputs["teacher_weight"] = inputs["teacher_weight"] * 60.0
    for backend in BACKENDS:
        loss, grads = run(inputs, backend)
        assert loss.isfinite() and all(g.isfinite().all() for g in grads.values()), backend
    assert math.isfinite(fp64_truth(inputs)[0].item())
