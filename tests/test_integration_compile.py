"""torch.compile(patched model): the plain causal batch runs SDPA with is_causal, every other
batch gets the mask transformers builds ("causal_mask", integrations/transformers/masks.py).

Tiny fp32 models on the CPU, lmkernels ops on the eager backend (the ops are not the point). The
compiled runs use dynamo with fullgraph=True and a backend that keeps each captured FX graph
and runs it as is: what SDPA is called with is read from the graphs, and numerics are those of
the traced program (no inductor rewrites). Loss and gradients must match plain transformers to
1e-5 relative, as in test_integration_transformers.py.
"""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the transformers integration needs the hf extra")

from transformers import masking_utils  # noqa: E402

from lmkernels.integrations import transformers as lk_hf  # noqa: E402
from lmkernels.integrations.transformers import masks, patching  # noqa: E402

B, T, V = 2, 24, 128
RTOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: torch's intra-op threads only add synchronization on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Graphs:
    """A dynamo backend that records the graphs it is given and runs them unchanged."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def sdpa_calls(self, since: int = 0) -> list[dict]:
        return [
            dict(node.kwargs)
            for gm in self.graphs[since:]
            for node in gm.graph.nodes
            if node.target is F.scaled_dot_product_attention
        ]


def _ids(seed=0, b=B, t=T):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def step(model, **inputs):
    """Loss and every parameter gradient of one training step."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def assert_same_step(result, reference):
    (loss, grads), (ref_loss, ref_grads) = result, reference
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        err = ((grads[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, f"{name}: relative gradient error {err:.2e}"


def _mask_globals(module) -> dict:
    return {name: getattr(module, name) for name in masks.mask_functions(vars(module))}


def test_revert_restores_the_mask_functions_and_the_forward():
    for other in lk_hf.patched_models():  # models other tests left patched share module-level patches
        lk_hf.revert(other)
    gc.collect()
    module = lk_hf.FAMILIES["llama"].module()
    original = {name: getattr(module, name) for name in ("create_causal_mask", "apply_rotary_pos_emb")}
    assert module.create_causal_mask is masking_utils.create_causal_mask
    first, second = lk_hf.tiny_model("llama"), lk_hf.tiny_model("llama", seed=1)
    for model in (first, second):
        lk_hf.apply(model, backend="eager")
        assert "forward" in vars(model.model)
        assert "causal_mask: LlamaModel" in lk_hf.report(model).summary()["patched"]
    assert getattr(module.create_causal_mask, "_lmkernels_patch", False)
    lk_hf.revert(first)
    assert "forward" not in vars(first.model)
    assert getattr(module.create_causal_mask, "_lmkernels_patch", False), "the second model still holds it"
    lk_hf.revert(second)
    assert "forward" not in vars(second.model)
    assert {name: getattr(module, name) for name in original} == original
    assert ("causal_mask", module.__name__) not in patching.MODULE_SAVED
    assert not lk_hf.family_patches("llama")

    lk_hf.apply("llama", backend="eager")  # class level: the base class's forward
    try:
        assert "forward" in vars(type(first.model)) and "mask functions" in " ".join(
            lk_hf.family_patches("llama")
        )
    finally:
        lk_hf.revert("llama")
    assert "forward" not in vars(type(first.model)) or not getattr(
        type(first.model).forward, "_lmkernels_patch", False
    )
    assert module.create_causal_mask is original["create_causal_mask"]

    # A deep copy outlives the original's hold on the mask functions: it then runs as plain.
    lk_hf.apply(first, backend="eager")
    clone = copy.deepcopy(first)
    lk_hf.revert(first)
    assert module.create_causal_mask is original["create_causal_mask"]
    ids = _ids(seed=6)
    assert_same_step(
        step(clone, input_ids=ids, labels=ids), step(lk_hf.tiny_model("llama"), input_ids=ids, labels=ids)
    )

    lk_hf.apply(first, backend="eager", ops=("rms_norm", "mlp", "flce", "rope"))  # not asked for
    assert "forward" not in vars(first.model) and module.create_causal_mask is original["create_causal_mask"]
    lk_hf.revert(first)


@pytest.fixture(scope="module")
def llama():
    """(plain, patched, compiled patched, its graphs): tiny Llama, SDPA, GQA 4 query / 2 kv
    heads, no KV cache in training (as benchmarks/e2e_setup.py builds it)."""
    plain = lk_hf.tiny_model("llama", use_cache=False)
    patched = lk_hf.apply(copy.deepcopy(plain), backend="eager")
    graphs = Graphs()
    return plain, patched, torch.compile(patched, fullgraph=True, backend=graphs), graphs


def test_plain_causal_batch_compiles_to_is_causal_sdpa(llama):
    plain, patched, compiled, graphs = llama
    ids = _ids()
    reference = step(plain, input_ids=ids, labels=ids)
    assert_same_step(step(patched, input_ids=ids, labels=ids), reference)
    start = len(graphs.graphs)
    assert_same_step(step(compiled, input_ids=ids, labels=ids), reference)
    calls = graphs.sdpa_calls(start)
    assert len(calls) == plain.config.num_hidden_layers
    for call in calls:
        assert call["attn_mask"] is None and call["is_causal"] is True and call.get("enable_gqa") is True, (
            call
        )
    compiled_graphs = len(graphs.graphs)
    ids2 = _ids(seed=1)
    assert_same_step(step(compiled, input_ids=ids2, labels=ids2), step(plain, input_ids=ids2, labels=ids2))
    assert len(graphs.graphs) == compiled_graphs, "the next step recompiled"


def test_first_call_inside_activation_checkpoints_compiles_fullgraph():
    """With activation checkpointing the first lmkernels calls of a compiled model can be traced
    inside a layer's checkpoint, where dynamo refuses any store to outside state (a model built
    from lmkernels.nn modules, compiled before any eager call). The registry's lazily cached
    state (each impl's availability, the parsed LMKERNELS_BACKEND) used to be stored there on
    first use: fullgraph=True failed with "HOP: Unsafe side effect". apply() fills those caches
    when it verifies its replacements, so they are emptied here, as in a fresh process."""
    from lmkernels.registry import core, dispatch

    plain = lk_hf.tiny_model("llama", use_cache=False)
    patched = lk_hf.apply(copy.deepcopy(plain), backend="eager")
    for model in (plain, patched):
        # transformers 5 renamed gradient checkpointing to activation checkpointing.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for impl in core.impls():
        impl.__dict__.pop("_availability", None)
    dispatch._invalidate()
    torch._dynamo.reset()
    graphs = Graphs()
    compiled = torch.compile(patched, fullgraph=True, backend=graphs)
    ids = _ids(seed=7)
    assert_same_step(step(compiled, input_ids=ids, labels=ids), step(plain, input_ids=ids, labels=ids))
    assert len(graphs.graphs) == 1
    assert core.get_impl("rms_norm", "eager").__dict__["_availability"] is None  # cached for real


def test_mask_wrapper_imports_nothing_while_traced():
    """What the mask wrapper runs on every call (and dynamo traces) holds no import statement:
    torch 2.11's dynamo refuses `from transformers import ...` in traced code (transformers is a
    _LazyModule, "Bad import result"), which failed the fullgraph compile above on the H200
    image; the CPU's torch 2.13 traces it, so only this check catches it here."""
    import dis

    wrapper = masks.mask_function_wrapper(masks.CAUSAL, masking_utils.create_causal_mask)
    traced = [wrapper, masks._is_causal_answer, masks._sdpa_is_stock, masks._empty_cache]
    for fn in traced:
        ops = {i.opname for i in dis.get_instructions(fn.__code__)}
        assert "IMPORT_NAME" not in ops, f"{fn.__name__} imports while traced"


def test_without_the_patch_compile_builds_the_mask(llama):
    """The control: plain transformers under compile passes a (B, 1, T, T) mask (with no cache,
    position_ids it made could be packed ones as far as it can tell while tracing)."""
    plain = llama[0]
    graphs = Graphs()
    compiled = torch.compile(copy.deepcopy(plain), fullgraph=True, backend=graphs)
    ids = _ids()
    compiled(input_ids=ids, labels=ids)
    calls = graphs.sdpa_calls()
    assert calls and all(c["attn_mask"] is not None and c["is_causal"] is False for c in calls)


def _padding_mask():
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    return mask


def _packed_positions():
    return torch.cat([torch.arange(10), torch.arange(T - 10)]).repeat(B, 1)  # two documents per row


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(lambda: {"attention_mask": _padding_mask()}, id="padding"),
        pytest.param(lambda: {"position_ids": _packed_positions()}, id="packed"),
    ],
)
def test_masked_batches_keep_their_mask_under_compile(llama, extra):
    plain, patched, compiled, graphs = llama
    ids, inputs = _ids(seed=2), extra()
    # (labels=ids as the plain steps pass them: the padded positions' labels are only compared)
    reference = step(plain, input_ids=ids, labels=ids, **inputs)
    assert_same_step(step(patched, input_ids=ids, labels=ids, **inputs), reference)
    start = len(graphs.graphs)
    assert_same_step(step(compiled, input_ids=ids, labels=ids, **inputs), reference)
    calls = graphs.sdpa_calls(start)
    assert calls and all(c["attn_mask"] is not None for c in calls), "the mask was dropped"


def test_generation_with_a_cache_matches_plain(llama):
    plain, patched = llama[0], llama[1]
    ids = _ids(seed=3, b=1, t=8)
    outputs = []
    for model in (plain, patched):
        model.eval()
        with torch.no_grad():
            outputs.append(
                model.generate(
                    ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
                )
            )
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    for a, b in zip(outputs[0].logits, outputs[1].logits):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=1e-6)


def test_threads_with_and_without_padding(llama):
    """Concurrent calls, one thread padded, one plain, eager and compiled: each gets its own answer."""
    plain, patched, compiled, _ = llama
    ids, mask = _ids(seed=5), _padding_mask()
    cases = {"plain": {}, "padded": {"attention_mask": mask}}
    # (grad mode on, as the other tests ran them: the compiled graphs of both cases are reused)
    expected = {k: plain(input_ids=ids, labels=ids, **kw).loss.detach() for k, kw in cases.items()}
    for kw in cases.values():
        compiled(input_ids=ids, labels=ids, **kw)  # compile both graphs (if not yet) before the race
    got = {k: [] for k in cases}
    barrier = threading.Barrier(2)

    def work(case):
        barrier.wait()
        for i in range(6):
            model = compiled if i % 2 else patched
            got[case].append(model(input_ids=ids, labels=ids, **cases[case]).loss.detach())

    threads = [threading.Thread(target=work, args=(case,)) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for case, losses in got.items():
        assert len(losses) == 6
        for loss in losses:
            torch.testing.assert_close(loss, expected[case], rtol=RTOL, atol=0)
    assert not torch.allclose(expected["plain"], expected["padded"]), "the two cases must differ"


def test_sliding_window_layers_keep_their_mask():
    """Qwen2 with a full layer and a sliding one (window 8 < T): only the full layer goes maskless.
    (Its config keeps use_cache on: the model makes an empty DynamicCache, still plain causal.)"""
    plain = lk_hf.tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert plain.config.layer_types == ["full_attention", "sliding_attention"] and plain.config.use_cache
    patched = lk_hf.apply(copy.deepcopy(plain), backend="eager")
    graphs = Graphs()
    compiled = torch.compile(patched, fullgraph=True, backend=graphs)
    ids = _ids(seed=4)
    reference = step(plain, input_ids=ids, labels=ids)
    assert_same_step(step(compiled, input_ids=ids, labels=ids), reference)
    full, sliding = graphs.sdpa_calls()
    assert full["attn_mask"] is None and full["is_causal"] is True
    assert sliding["attn_mask"] is not None and sliding["is_causal"] is False


def test_fails_closed_where_attention_mask_is_used_otherwise():
    """GPT-2 reshapes attention_mask itself; Gemma3 copies its mask kwargs: kept, with the reason."""
    for model_type, reason in (("gpt2", "attention_mask.view"), ("gemma3_text", "mask_kwargs.copy")):
        report = lk_hf.patch_report(model_type, backend="eager", ops=("causal_mask",))
        (finding,) = report.findings
        assert finding.status == "kept" and reason in finding.detail, report.format()
    model = lk_hf.tiny_model("llama")
    attention = model.model.layers[0].self_attn

    class OwnSdpaAttention(type(attention)):  # reads a None mask as "no mask", not as causal
        def forward(self, hidden_states, *args, attention_mask=None, **kwargs):
            q = hidden_states[:, None]
            return F.scaled_dot_product_attention(q, q, q, attn_mask=attention_mask)[:, 0], None

    attention.__class__ = OwnSdpaAttention
    (finding,) = lk_hf.patch_report(model, ops=("causal_mask",)).findings
    assert finding.status == "kept" and "OwnSdpaAttention calls scaled_dot_product" in finding.detail
    with pytest.raises(masks.MarkerMisuse, match="outside the mask functions"):
        masks.PLAIN_CAUSAL.shape  # noqa: B018


def test_cache_argument_under_either_name():
    """transformers 5.24 renamed the base models' past_key_values argument (and the mask
    functions') to cache: the patch takes either name, whichever transformers is installed."""
    from types import SimpleNamespace

    stock = masks._stock_objects()
    config = SimpleNamespace(is_causal=True, _attn_implementation="sdpa")
    full = object()  # not the empty DynamicCache the base model makes: a real cache
    for name in masks.CACHE_ARGS:
        assert masks._is_causal_answer({"config": config, name: None}, stock)
        assert not masks._is_causal_answer({"config": config, name: full}, stock)

    class Base(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None):
            return masking_utils.create_causal_mask(attention_mask=attention_mask)

    class Renamed(Base):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None):
            return masking_utils.create_causal_mask(attention_mask=attention_mask, cache=cache)

    assert masks.forward_problem(Base()) == "forward has no past_key_values or cache argument"
    assert "argument" not in (masks.forward_problem(Renamed()) or "")
