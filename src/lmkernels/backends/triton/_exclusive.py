"""May a backward write its results over memory it was handed? Proofs from reference counts.

An in-place backward saves an allocation by writing a gradient into a buffer it received: the
incoming gradient (RMSNorm writes dx into dy) or a tensor saved for backward (GLU writes d_gate
over gate and d_up over up). That is only safe when nobody else can see the buffer, so the
decision is made from what holds it:

- holders of its TensorImpl (autograd nodes that saved it, the caller's tensors, a hook's list);
- holders of its storage (views, detach(), .data, a node that saved it as its own output);
- Python references to it (the caller's name for it, a tensor hook that keeps it, retain_grad).

The counts an exclusive buffer shows depend on the torch build and the device (autograd's engine
may hold a reference of its own), so each check is relative to a baseline measured once per
device type by a probe autograd.Function on a buffer that is exclusive by construction. The
probe runs the same code path, so the counts differ only where a real holder exists. Any doubt
(counts unavailable, tensor subclass, functorch wrapper, no baseline, storage not ours to
reuse) answers "not exclusive", and the caller allocates as usual.
"""

from __future__ import annotations

import sys
import weakref

import torch

Counts = tuple[int, int, int]


def reference_counts(t: torch.Tensor) -> Counts:
    """(holders of t's TensorImpl, holders of its storage, Python references to t).

    The storage count includes the temporary Python storage object made here.
    """
    storage = t.untyped_storage()
    storage_count = torch._C._storage_Use_Count(storage._cdata)
    del storage
    return t._use_count(), storage_count, sys.getrefcount(t)


def _countable(t) -> bool:
    """A plain tensor on memory torch allocated: not a subclass or functorch wrapper (their
    counts mean something else), not memory borrowed from elsewhere (torch.from_numpy,
    from_dlpack, frombuffer: not resizable) or shared with other processes."""
    if type(t) is not torch.Tensor or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    storage = t.untyped_storage()
    if not storage.resizable():
        return False
    return not (storage.device.type == "cpu" and storage.is_shared())


def _within(counts, baseline) -> bool:
    return baseline is not None and all(c <= b for c, b in zip(counts, baseline))


# --- the incoming gradient -----------------------------------------------------------------------


def excess_holders(dy, control) -> tuple[int, ...] | None:
    """How many more holders dy has than `control`, per count of reference_counts.

    `control` is the gradient autograd materializes for a non-differentiable output of the same
    Function (RMSNorm's rstd, GLU's control output): a fresh tensor handed to the backward next
    to dy (same Python tuples and frames), so counting both in the same place cancels every
    reference the calling machinery takes to both of them. Take it first thing in the backward.
    None where the counts mean nothing: a tensor subclass, a functorch wrapper, a missing API.
    """
    try:
        if type(control) is not torch.Tensor or not _countable(dy):
            return None
        return tuple(a - b for a, b in zip(reference_counts(dy), reference_counts(control)))
    except (AttributeError, RuntimeError):
        return None


class ExclusiveGradientProbe(torch.autograd.Function):
    """Shaped like the Functions that check their gradient (a differentiable output and a
    non-differentiable one) to measure, in its backward, the excess holders of a gradient known
    to be exclusive."""

    @staticmethod
    def forward(ctx, x):
        stats = x.new_zeros(x.shape[:-1])
        ctx.mark_non_differentiable(stats)
        return x.clone(), stats

    @staticmethod
    def backward(ctx, dy, control):
        ctx.excess = excess_holders(dy, control)
        return dy


EXCLUSIVE_GRAD_EXCESS: dict[str, tuple[int, ...] | None] = {}


def exclusive_grad_excess(device: torch.device) -> tuple[int, ...] | None:
    """excess_holders of an exclusive gradient on this device type with this torch build.

    Autograd itself may keep a reference to the gradient while a backward runs, and not to the
    control (torch 2.11 on CUDA showed dy with one more TensorImpl holder and one more Python
    reference than the control for a gradient nobody else could see; torch 2.13 on CPU shows
    none). So the baseline is measured, once per device type, on a gradient that is exclusive by
    construction: (probe * 2).sum() hands the probe a product only it receives.
    """
    if device.type not in EXCLUSIVE_GRAD_EXCESS:
        excess = None
        try:
            with torch.enable_grad():
                x = torch.zeros(2, 4, device=device, requires_grad=True)
                y, _ = ExclusiveGradientProbe.apply(x)
                torch.autograd.grad((y * 2.0).sum(), x)
                excess = y.grad_fn.excess
        except (AttributeError, RuntimeError):
            pass
        EXCLUSIVE_GRAD_EXCESS[device.type] = excess
    return EXCLUSIVE_GRAD_EXCESS[device.type]


def grad_is_exclusive(excess: tuple[int, ...] | None, device: torch.device) -> bool:
    """True when nobody but this backward can see dy's memory, so a result may be written into it.

    `excess` is excess_holders(dy, control), taken first thing in the backward. dy is
    exclusive when it has no more holders than an exclusive gradient has (exclusive_grad_excess):
    - no other TensorImpl holder: autograd passing the same gradient to two consumers (e.g.
      both inputs of an add) keeps one until the other consumer has run;
    - no other holder of its storage: views, detach(), .data, a retained copy sharing it;
    - no other Python reference: the caller's tensor in y.backward(grad), a tensor hook keeping
      the gradient, y.retain_grad(), ...
    Any doubt (counts unavailable, no baseline) answers False.
    """
    return excess is not None and _within(excess, exclusive_grad_excess(device))


# --- tensors saved for backward ------------------------------------------------------------------


def saved_tensors_and_counts(ctx) -> tuple[tuple, list[Counts | None]]:
    """ctx.saved_tensors and, for each, reference_counts (None where they mean nothing).

    Unpacks the saved tensors itself: the Python references counted are those of this frame,
    the same in a Function's backward and in the probe's. Call it once, first thing.
    """
    saved = ctx.saved_tensors
    counts: list[Counts | None] = []
    for t in saved:
        try:
            counts.append(reference_counts(t) if _countable(t) else None)
        except (AttributeError, RuntimeError):
            counts.append(None)
    return saved, counts


class ExclusiveSavedProbe(torch.autograd.Function):
    """Saves two intermediates only it holds and records, in its backward, their counts."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        _, ctx.counts = saved_tensors_and_counts(ctx)
        return grad, None


EXCLUSIVE_SAVED_COUNTS: dict[str, Counts | None] = {}


def exclusive_saved_counts(device: torch.device) -> Counts | None:
    """reference_counts of an exclusive saved tensor, unpacked in a backward, on this device
    type with this torch build: measured once on x * 2 and x * 3, intermediates that only the
    probe's saved-tensor slots hold. Not measured (None, retried next time) while saved-tensor
    hooks are active: the probe's tensors would go through them."""
    if device.type not in EXCLUSIVE_SAVED_COUNTS:
        try:
            if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
                return None
        except (AttributeError, RuntimeError):
            pass
        baseline = None
        try:
            with torch.enable_grad():
                x = torch.zeros(2, 4, device=device, requires_grad=True)
                y = ExclusiveSavedProbe.apply(x * 2.0, x * 3.0)
                torch.autograd.grad(y.sum(), x)
                first, second = y.grad_fn.counts
                baseline = first if first == second else None
        except (AttributeError, RuntimeError, ValueError):
            pass
        EXCLUSIVE_SAVED_COUNTS[device.type] = baseline
    return EXCLUSIVE_SAVED_COUNTS[device.type]


def saved_is_exclusive(t: torch.Tensor, counts: Counts | None) -> bool:
    """True when nobody but autograd's saved-tensor slot (or the unpack hook that handed it over)
    holds t, so t's memory may be overwritten by this backward.

    `counts` is t's entry from saved_tensors_and_counts. Beyond the counts (no more holders than
    an exclusive saved tensor has, see exclusive_saved_counts): t must own its whole storage
    (contiguous, storage offset 0, storage exactly t's size: not a view into a larger buffer such
    as chunk() of a fused gate_up), not be a leaf that requires grad (its AccumulateGrad node and
    the caller hold it), and have no weak references. The caller checks the rest: grad mode off,
    not traced, the graph not retained (graph_is_retained).

    Under saved-tensor hooks (non-reentrant checkpointing, save_on_cpu) the unpacked tensor is a
    new TensorImpl on the memory the unpack hook returned, and autograd holds neither: counts
    (1, 2, 4) against the probe's (2, 2, 5) with torch 2.13 on CPU. Any other holder of the
    memory still shows, as a holder of the storage (the hook's tensor, if anything keeps it), so
    "no count above the baseline" is the rule for both.
    """
    if counts is None:
        return False
    try:
        if (
            not t.is_contiguous()
            or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()
            or (t.is_leaf and t.requires_grad)
            or t._base is not None
            or weakref.getweakrefcount(t)
        ):
            return False
    except (AttributeError, RuntimeError):
        return False
    baseline = exclusive_saved_counts(t.device)
    if _within(counts, baseline):
        return True
    return _within(counts, _remeasured_saved_counts(t.device, counts, baseline))


# Count patterns above the baseline seen since it was last measured, per device type.
_SAVED_MISMATCHES: dict[str, set[Counts]] = {}


def _remeasured_saved_counts(device: torch.device, counts: Counts, baseline: Counts | None) -> Counts | None:
    """The baseline measured again, once per new pattern of counts above it.

    Counts above the baseline mean a real holder, or a process-wide shift since the baseline was
    measured: after a long pytest session (torch 2.13, CPU), every unpacked saved tensor showed
    one more Python reference, the probe's own included, with nothing in gc.get_referrers, so
    the in-place backward stopped engaging. A fresh probe measures the shift under the same
    conditions as this backward, so a real holder still shows above it; a pattern already seen
    against this baseline is not measured again (a caller that keeps its tensors costs one
    probe run, not one per call).
    """
    seen = _SAVED_MISMATCHES.setdefault(device.type, set())
    if baseline is None or counts in seen:  # None: this torch cannot be measured
        return baseline
    EXCLUSIVE_SAVED_COUNTS.pop(device.type, None)
    fresh = exclusive_saved_counts(device)
    if fresh != baseline:
        seen.clear()
    seen.add(counts)
    return fresh


def graph_is_retained() -> bool | None:
    """Whether the running backward keeps the graph (retain_graph=True): its saved tensors are
    then read again by a later backward and must not be overwritten. None when this torch cannot
    tell (treat as retained)."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):
        return None
