"""lmkernels.integrations.transformers: patched models compute what transformers computes.

Tiny random models of every supported family (lmkernels.convergence.models), fp32 on the CPU.
Tolerances: the loss and every parameter gradient of the patched model must match the unpatched
one to 1e-5 relative (gradients: ||g_patched - g|| / ||g|| per tensor). Measured differences are
~2e-7 (loss) and ~1e-6 (gradients): the fused loss sums in another order (logsumexp over the
vocabulary, then over 512 tokens), about 100 ulps of fp32 through a 2-layer model at most. A
wrong op (missing offset, swapped rope halves, wrong shift) is off by O(1).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import os

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")

import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import lmkernels  # noqa: E402
from lmkernels.convergence.models import FAMILIES, build_model  # noqa: E402
from lmkernels.integrations import transformers as lk_hf  # noqa: E402
from lmkernels.registry import LMKernelsError  # noqa: E402

B, T, V = 8, 64, 512  # the convergence test's shapes, so compiled kernels are shared
RTOL = 1e-5


def tiny(family: str, seed: int = 0):
    return build_model(family, V, T, seed=seed)


def batch(seed: int = 0, ignore: bool = True, b: int = B, t: int = T):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t), generator=g)
    labels = ids.clone()
    if ignore:  # padding-like ignored tails and a few ignored tokens inside
        labels[0, -10:] = -100
        labels[-1, 5] = -100
    return ids, labels


def loss_and_grads(model, forward_context=contextlib.nullcontext, **inputs):
    model.train()
    model.zero_grad(set_to_none=True)
    with forward_context():
        out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same_training_step(reference, patched, forward_context=contextlib.nullcontext, **inputs):
    ref_out, ref_grads = loss_and_grads(reference, forward_context, **inputs)
    out, grads = loss_and_grads(patched, forward_context, **inputs)
    assert out.logits is None, "the fused path must not return logits"
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        err = ((grads[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, f"{name}: relative gradient error {err:.2e} > {RTOL}"


def _triton_covered_ops():
    """Patch ops the triton backend can run here, or a skip reason."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        return None, "triton runs on the CPU only under TRITON_INTERPRET=1 (set it for the whole session)"
    from lmkernels.convergence.compare import covered_ops

    try:
        ops, note = covered_ops("triton", tiny("llama"), "cpu")
    except LMKernelsError as e:
        return None, f"triton backend not usable here: {e}"
    return ops, note


def _patched(reference, backend):
    """A patched copy of reference, with the Triton backend limited to the ops it runs here."""
    ops = lk_hf.SUPPORTED_OPS
    if backend == "triton":
        ops, reason = _triton_covered_ops()
        if ops is None:
            pytest.skip(reason)
    return lk_hf.apply(copy.deepcopy(reference), backend=backend, ops=ops)


BACKENDS = [
    pytest.param("eager", id="eager"),
    pytest.param("compile", id="compile"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_transformers(family, backend):
    reference = tiny(family)
    patched = lk_hf.apply(copy.deepcopy(reference), backend=backend)
    ids, labels = batch()
    assert_same_training_step(reference, patched, input_ids=ids, labels=labels)


# The interpreter runs every kernel program in numpy: two families (both norm casting modes, SwiGLU
# and GeGLU, the final-logit softcap) and a 2 x 16 batch keep it to seconds.
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_patched_model_matches_transformers_triton(family):
    reference = tiny(family)
    patched = _patched(reference, "triton")
    ids, labels = batch(b=2, t=16)
    assert_same_training_step(reference, patched, input_ids=ids, labels=labels)


# The backends' saved tensors pass through other code's saved-tensor hooks here: copies made at
# the forward and handed back in the backward (activation offloading; the Triton GLU may write
# its gradients over what it is handed), and a layer recomputed while the next one is not.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_.* is deprecated:FutureWarning")
@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("triton", id="triton")])
def test_activation_offloading_around_checkpointed_layers(backend):
    """Every layer checkpointed and the whole forward under torch's save_on_cpu, as
    transformers' activation_checkpointing_enable(offload=True) does (save_on_cpu around each
    checkpoint), here without pinned memory, which needs an accelerator."""
    reference = tiny("llama")
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    patched = _patched(reference, backend)
    ids, labels = batch(b=2, t=16) if backend == "triton" else batch()
    offload = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=False)
    assert_same_training_step(reference, patched, offload, input_ids=ids, labels=labels)


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("triton", id="triton")])
def test_every_other_layer_checkpointed(backend):
    reference = tiny("llama")
    enable = getattr(reference, "activation_checkpointing_enable", None)
    if enable is None or "every_n_layers" not in inspect.signature(enable).parameters:
        pytest.skip(f"transformers {transformers.__version__} cannot checkpoint every n-th layer only")
    enable(every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in reference.model.layers] == [True, False]
    patched = _patched(reference, backend)
    ids, labels = batch(b=2, t=16) if backend == "triton" else batch()
    assert_same_training_step(reference, patched, input_ids=ids, labels=labels)


def test_rope_with_half_width_tables():
    """GPT-OSS passes cos/sin of head_dim / 2 columns, one per rotated pair, for both halves
    of the head (the neox layout). Its attention layers alternate sliding windows (8 < T here)
    and full attention; its experts clamp their GLU, which no lmkernels op computes."""
    reference = lk_hf.tiny_model("gpt_oss", seed=0, attn_implementation="eager", sliding_window=8)
    with pytest.raises(LMKernelsError, match="apply with ops excluding 'mlp'"):
        lk_hf.apply(copy.deepcopy(reference), backend="eager")
    patched = lk_hf.apply(
        copy.deepcopy(reference), backend="eager", ops=("rms_norm", "rope", "flce", "causal_mask")
    )
    rope = [f for f in lk_hf.report(patched).patched if f.op == "rope"]
    assert [f.detail for f in rope] == ["neox, half-width table"]
    ids = torch.randint(0, reference.config.vocab_size, (B, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, -5:] = -100
    assert_same_training_step(reference, patched, input_ids=ids, labels=labels)


def test_rope_refusal_names_what_is_missing():
    """DeepSeek-V3's attention (MLA) ropes a slice of each head and has no head_dim: the report
    says so rather than blaming the function's signature, which is the usual one."""
    mla = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
    model = lk_hf.tiny_model("deepseek_v3", v_head_dim=16, head_dim=8, n_routed_experts=4, **mla)
    rope = [f for f in lk_hf.patch_report(model, backend="eager").failed if f.op == "rope"]
    assert [f.detail for f in rope] == ["DeepseekV3Attention has no integer head_dim or head_size"]


def test_batched_position_ids_and_per_op_backends():
    """cos/sin with a batch dim (per-row offsets), and a backend spec mixing backends per op."""
    reference = tiny("llama")
    patched = lk_hf.apply(copy.deepcopy(reference), backend="eager,flce=compile,rope=compile")
    ids, labels = batch()
    position_ids = torch.arange(T)[None] + torch.arange(B)[:, None] * 3
    assert_same_training_step(reference, patched, input_ids=ids, labels=labels, position_ids=position_ids)


def test_num_items_in_batch_like_transformers():
    """The Trainer passes num_items_in_batch (tokens over all accumulated micro-batches): the loss
    is then sum / num_items_in_batch, not the micro-batch mean."""
    reference = tiny("llama")
    patched = lk_hf.apply(copy.deepcopy(reference), backend="eager")
    ids, labels = batch()
    n_items = torch.tensor(3 * int((labels[:, 1:] != -100).sum()))  # as if 3 micro-batches
    assert_same_training_step(reference, patched, input_ids=ids, labels=labels, num_items_in_batch=n_items)
    mean_loss = patched(input_ids=ids, labels=labels).loss
    sum_loss = patched(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
    torch.testing.assert_close(sum_loss * 3, mean_loss, rtol=RTOL, atol=0)


def test_shift_labels_and_logits_to_keep():
    reference = tiny("qwen2")
    patched = lk_hf.apply(copy.deepcopy(reference), backend="eager")
    ids, labels = batch()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shift[:, :7] = -100  # different from what labels would give, so shift_labels must win
    assert_same_training_step(reference, patched, input_ids=ids, labels=labels, shift_labels=shift)
    # logits_to_keep=k with labels for the last k positions: transformers' loss on the kept logits.
    k = 20
    assert_same_training_step(reference, patched, input_ids=ids, labels=labels[:, -k:], logits_to_keep=k)


def test_without_labels_or_in_eval_logits_are_returned():
    reference = tiny("gemma2")
    patched = lk_hf.apply(copy.deepcopy(reference), backend="eager")
    ids, labels = batch()
    for mode in ("train", "eval"):
        getattr(reference, mode)()
        getattr(patched, mode)()
        with torch.no_grad():
            ref = reference(input_ids=ids)
            out = patched(input_ids=ids)
        assert out.logits is not None and out.logits.shape == (B, T, V)
        torch.testing.assert_close(out.logits, ref.logits, rtol=RTOL, atol=1e-5)
    reference.eval()
    patched.eval()
    with torch.no_grad():
        ref = reference(input_ids=ids, labels=labels)
        out = patched(input_ids=ids, labels=labels)
    assert out.logits is not None  # evaluation keeps logits for metrics
    torch.testing.assert_close(out.loss, ref.loss, rtol=RTOL, atol=0)


def test_return_dict_false():
    patched = lk_hf.apply(tiny("llama"), backend="eager")
    ids, labels = batch()
    patched.train()
    out = patched(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], patched(input_ids=ids, labels=labels).loss, rtol=0, atol=0)


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_training_step_never_materializes_logits():
    """With labels in training no tensor of B*T*V elements exists: the fused loss (the chunked
    compile backend here; the eager reference would build the logits itself) gets the hidden
    states, lm_head never runs. The same recorder on the unpatched model sees the logits."""
    reference = tiny("llama")
    patched = lk_hf.apply(copy.deepcopy(reference), backend="eager,flce=compile")
    ids, labels = batch()
    lm_head_calls = []
    patched.lm_head.register_forward_hook(lambda *a: lm_head_calls.append(1))
    # warm up outside the recorder (compilation allocates nothing of interest, but is slow)
    loss_and_grads(patched, input_ids=ids, labels=labels)
    lm_head_calls.clear()

    seen = MaxNumel()
    with seen:
        out, _ = loss_and_grads(patched, input_ids=ids, labels=labels)
    assert out.logits is None
    assert not lm_head_calls, "lm_head ran: the logits were computed"
    assert seen.max_numel < B * T * V, (
        f"a tensor of {seen.max_numel} >= B*T*V = {B * T * V} elements was created"
    )

    control = MaxNumel()
    with control:
        loss_and_grads(reference, input_ids=ids, labels=labels)
    assert control.max_numel >= B * T * V  # the recorder does see the logits of the plain model


def _forwards(model):
    return {name: vars(m).get("forward") for name, m in model.named_modules()}


def test_instance_patch_and_revert_restore_exactly():
    module = lk_hf.FAMILIES["llama"].module()
    original_rope = module.apply_rotary_pos_emb
    assert not getattr(original_rope, "_lmkernels_patch", False)
    model = tiny("llama")
    other = tiny("llama", seed=1)
    ids, labels = batch()
    before, _ = loss_and_grads(model, input_ids=ids, labels=labels)
    assert all(f is None for f in _forwards(model).values())

    lk_hf.apply(model, backend="eager")
    assert lk_hf.is_patched(model) and not lk_hf.is_patched(other)
    patched_names = {n for n, f in _forwards(model).items() if f is not None}
    assert "" in patched_names and "model.norm" in patched_names and "model.layers.0.mlp" in patched_names
    assert all(f is None for f in _forwards(other).values()), "another instance was patched"
    assert module.apply_rotary_pos_emb is original_rope  # the patched attentions have their own

    lk_hf.apply(model, backend="compile", ops=("rms_norm",))  # re-apply replaces the first patch
    assert {n for n, f in _forwards(model).items() if f is not None} < patched_names
    assert module.apply_rotary_pos_emb is original_rope

    lk_hf.revert(model)
    assert not lk_hf.is_patched(model)
    assert all(f is None for f in _forwards(model).values())
    assert module.apply_rotary_pos_emb is original_rope
    after, _ = loss_and_grads(model, input_ids=ids, labels=labels)
    assert torch.equal(after.loss, before.loss) and torch.equal(after.logits, before.logits)
    lk_hf.revert(model)  # reverting twice is harmless

    lk_hf.apply(model, backend="eager")
    assert module.apply_rotary_pos_emb is original_rope


def test_class_patch_before_construction():
    family = lk_hf.FAMILIES["gemma"]
    classes = [family.cls("RMSNorm"), family.cls("MLP"), family.cls("ForCausalLM")]
    originals = [vars(c)["forward"] for c in classes]
    original_rope = family.module().apply_rotary_pos_emb
    ids, labels = batch()
    ref_out, ref_grads = loss_and_grads(tiny("gemma"), input_ids=ids, labels=labels)
    try:
        lk_hf.apply(transformers.GemmaForCausalLM, backend="eager")
        assert all(getattr(vars(c)["forward"], "_lmkernels_patch", False) for c in classes)
        model = tiny("gemma")  # built after patching the class: same seed, same weights
        assert not lk_hf.is_patched(model) and lk_hf.is_patched("gemma")
        out, grads = loss_and_grads(model, input_ids=ids, labels=labels)
    finally:
        lk_hf.revert(transformers.GemmaForCausalLM)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=0)
    for name, g in ref_grads.items():
        assert ((grads[name] - g).norm() / g.norm()).item() <= RTOL, name
    assert all(vars(c)["forward"] is o for c, o in zip(classes, originals))
    assert family.module().apply_rotary_pos_emb is original_rope
    assert not lk_hf.is_patched("gemma")


def test_unknown_targets_raise_and_other_models_patch_by_structure():
    """Model types are no longer a fixed list: GPT-2 (not one of the five original families) gets
    its LayerNorms and head patched and its non-gated MLP kept; what is not a model raises."""
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    )
    lk_hf.apply(gpt2, backend="eager")
    report = lk_hf.report(gpt2).summary()
    assert "layer_norm: LayerNorm x3" in report["patched"]
    assert "mlp: GPT2MLP" in report["kept"] and not report["failed"]
    lk_hf.revert(gpt2)
    with pytest.raises(LMKernelsError, match="'no_such_type' has no causal LM"):
        lk_hf.apply("no_such_type")
    with pytest.raises(LMKernelsError, match="^ops: unknown"):
        lk_hf.apply(tiny("llama"), ops=("rms_norm", "attention"))
    with pytest.raises(LMKernelsError, match="backend"):
        lk_hf.apply(tiny("llama"), backend="no_such_backend")
    with pytest.raises(LMKernelsError, match="model_or_class"):
        lk_hf.apply(42)


def test_unsupported_activation_and_custom_loss_raise_before_patching():
    model = build_model("llama", V, T, hidden_act="relu")
    with pytest.raises(LMKernelsError, match="activation ReLU has no lmkernels GLU op"):
        lk_hf.apply(model)
    assert not lk_hf.is_patched(model) and all(f is None for f in _forwards(model).values())
    lk_hf.apply(model, ops=("rms_norm", "rope", "flce"))  # fine without the MLP
    lk_hf.revert(model)

    model = tiny("llama")
    model.loss_function = lambda *a, **k: 0.0
    with pytest.raises(LMKernelsError, match="custom loss_function"):
        lk_hf.apply(model)


class _ScaledHead(torch.nn.Linear):
    """An lm_head with a learned logit scale per vocabulary entry, 1 at initialization (as
    transformers' DoryLMHead): its own forward, which a fused loss reading the weight skips."""

    def __init__(self, linear):
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.weight = linear.weight
        self.logit_scale = torch.nn.Parameter(torch.ones(linear.out_features))

    def forward(self, x):
        return super().forward(x) * self.logit_scale


def test_lm_head_with_its_own_forward_or_parameters_outside_is_not_fused():
    reference = tiny("llama")
    reference.lm_head = _ScaledHead(reference.lm_head)
    with pytest.raises(LMKernelsError, match="lm_head is a _ScaledHead, whose forward is not nn.Linear's"):
        lk_hf.apply(copy.deepcopy(reference), backend="eager")
    patched = lk_hf.apply(copy.deepcopy(reference), backend="eager", strict=False)
    assert "flce" not in lk_hf.report(patched).patched_ops()
    ids, labels = batch()
    ref_out, ref_grads = loss_and_grads(reference, input_ids=ids, labels=labels)
    out, grads = loss_and_grads(patched, input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=0)
    torch.testing.assert_close(
        grads["lm_head.logit_scale"], ref_grads["lm_head.logit_scale"], rtol=RTOL, atol=0
    )

    other = tiny("llama")
    other.logit_bias = torch.nn.Parameter(torch.zeros(V))  # as if its forward added it to the logits
    with pytest.raises(LMKernelsError, match="logit_bias is outside model and lm_head"):
        lk_hf.apply(other, backend="eager")


def test_transformers_version_check():
    lk_hf.check_transformers_version()  # the installed version is supported
    for version in ("4.49.0", "4.57.1", "6.0.0"):
        with pytest.raises(LMKernelsError, match=f"transformers {version} is not supported"):
            lk_hf.check_transformers_version(version)
    lk_hf.check_transformers_version("5.17.0")


def test_lmkernels_ops_are_really_called():
    """Not vacuous: the patched model dispatches to the op impls (counted through a spy backend)."""
    calls = {}

    def spy(op):
        reference = lmkernels.get_op(op).reference

        def fn(**inputs):
            calls[op] = calls.get(op, 0) + 1
            return reference(**inputs)

        return fn

    ops = ("rms_norm", "rope", "geglu", "fused_linear_cross_entropy")
    for op in ops:
        lmkernels.register(op, "spy", spy(op), priority=-1000)
    try:
        model = lk_hf.apply(tiny("gemma2"), backend="spy")
        assert calls, "apply() verifies each replacement with the backend it will use"
        calls.clear()
        ids, labels = batch()
        loss_and_grads(model, input_ids=ids, labels=labels)
    finally:
        for op in ops:
            lmkernels.registry.unregister(op, "spy")
    # 2 layers: 4 norms each + the final norm; one rope per layer; one MLP per layer, whose GLU
    # runs again in the backward (down_proj's input is recomputed, lmkernels.nn.recompute); one loss.
    assert calls == {"rms_norm": 9, "rope": 2, "geglu": 4, "fused_linear_cross_entropy": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak GPU memory needs a CUDA device")
def test_gpu_peak_memory_below_logits_size():
    """A patched Llama with Llama 3's vocabulary trains a step with labels using less memory above
    its inputs than its bf16 logits alone would take (2.1 GB); the plain model needs more.

    8192 tokens: more than the Triton FLCE's largest chunk (1 GiB of fp32 logits, 2048 tokens
    at this vocabulary), so the chunking is what keeps the peak down."""
    vocab, batch_size, seq = 128_256, 4, 2048
    logits_bytes = batch_size * seq * vocab * 2

    def peak_step(patch: bool) -> int:
        gc.collect()
        torch.cuda.empty_cache()
        model = build_model("llama", vocab, seq, hidden_size=256, intermediate_size=704)
        model = model.to("cuda", torch.bfloat16)
        if patch:
            lk_hf.apply(model)  # backend None: dispatch picks the best available (Triton on CUDA)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, vocab, (batch_size, seq), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        opt.step()
        assert torch.isfinite(loss)
        if patch:
            lk_hf.revert(model)
        return peak

    peak_step(True)  # warm-up: compilation and autotuning allocate scratch memory once
    patched_peak = peak_step(True)
    plain_peak = peak_step(False)
    assert plain_peak > logits_bytes, "the measurement should see the plain model's logits"
    assert patched_peak < logits_bytes, (
        f"patched step used {patched_peak / 2**20:.0f} MiB above its inputs; the bf16 logits alone "
        f"are {logits_bytes / 2**20:.0f} MiB"
    )


def test_rope_behind_a_hub_kernel_module(monkeypatch):
    """With the `kernels` package installed, transformers' hub-kernel decorator turns
    apply_rotary_pos_emb into an nn.Module that calls it (its forward given the function's
    signature): still recognized, patched, and reverted to that module."""
    import inspect

    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb

    class HubFunction(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return original(*args, **kwargs)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    HubFunction.forward.__signature__ = inspect.Signature(
        params + list(inspect.signature(original).parameters.values())
    )
    hub = HubFunction()
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", hub)
    plain = lk_hf.tiny_model("llama", seed=0)
    model = lk_hf.apply(lk_hf.tiny_model("llama", seed=0), backend="eager")
    assert "rope" in {f.op for f in lk_hf.report(model).patched}
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-6)
    lk_hf.revert(model)
    assert modeling_llama.apply_rotary_pos_emb is hub
