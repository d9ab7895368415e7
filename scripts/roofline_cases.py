"""The measured cases of scripts/roofline_tune.py: inputs, the fp32 truth, the check of a
candidate against it (error <= 2x the eager bf16 error + 1e-3, DESIGN.md's bf16 policy), and the
peers (torch.compile of the eager reference, Liger when importable)."""

from __future__ import annotations

import os

import torch

E = 2  # bytes per bf16 element
DEVICE = "cuda"


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# --- cases --------------------------------------------------------------------------------------


def _liger():
    try:
        from lmkernels.backends import adapters

        if adapters.liger_unavailable() is None:
            return adapters
    except Exception:  # noqa: BLE001 (Liger is optional: no column then)
        pass
    return None


class NormCase:
    def __init__(self, op, M, N):
        from lmkernels.ops.layer_norm import layer_norm_reference
        from lmkernels.ops.rms_norm import rms_norm_reference

        self.op, self.M, self.N = op, M, N
        g = torch.Generator(device=DEVICE).manual_seed(M * 7 + N)
        shift = 0.5 if op == "layer_norm" else 0.0
        self.x = (torch.randn(M, N, device=DEVICE, generator=g) + shift).bfloat16()
        self.w = (torch.randn(N, device=DEVICE, generator=g) * 0.5 + 1).bfloat16()
        self.b = (torch.randn(N, device=DEVICE, generator=g) * 0.5).bfloat16() if op == "layer_norm" else None
        self.dy = torch.randn(M, N, device=DEVICE, generator=g).bfloat16()
        self.ref = layer_norm_reference if op == "layer_norm" else rms_norm_reference
        self.params = [self.w] + ([self.b] if self.b is not None else [])
        self.bytes = 5 * M * N * E

    def args(self, x, params):
        return (x, *params)

    def leaves(self):
        x = self.x.detach().requires_grad_()
        params = [p.detach().requires_grad_() for p in self.params]
        return x, params

    def run_full(self, fn):
        x, params = self.leaves()

        def call():
            x.grad = None
            for p in params:
                p.grad = None
            torch.autograd.backward(fn(x, *params), self.dy)

        return call, x, params

    def truth(self):
        if "_truth" not in self.__dict__:
            x = self.x.float().requires_grad_()
            params = [p.float().requires_grad_() for p in self.params]
            y = self.ref(x, *params)
            y.backward(self.dy.float())
            self.__dict__["_truth"] = [y.detach(), x.grad] + [p.grad for p in params]
            self.__dict__["eager_err"] = self.errors(lambda *a: self.ref(*a))
        return self.__dict__["_truth"]

    def errors(self, fn):
        from lmkernels.utils import poison_outputs

        call, x, params = self.run_full(fn)
        x.grad = None
        # Outputs start as NaN (as under the harness): an element a variant forgets to write
        # fails the check instead of passing on the last variant's result in reused memory.
        with poison_outputs():
            y = fn(x, *params)
            torch.autograd.backward(y, self.dy)
        outs = [y.detach(), x.grad] + [p.grad for p in params]
        return [rel_err(o, t) for o, t in zip(outs, self.truth())]

    def check(self, fn):
        """None if fn passes (every output within 2x eager + 1e-3), else a reason."""
        errs = self.errors(fn)
        eager = self.__dict__["eager_err"]
        names = ["y", "dx", "dw", "db"]
        for name, e, ee in zip(names, errs, eager):
            if not (e <= 2 * ee + 1e-3):
                return f"{name} rel err {e:.3g} > 2 x eager {ee:.3g} + 1e-3"
        return None

    def triton_fn(self):
        import lmkernels

        if self.op == "rms_norm":
            return lambda x, w: lmkernels.rms_norm(x, w, backend="triton")
        return lambda x, w, b: lmkernels.layer_norm(x, w, b, backend="triton")

    def peers(self):
        out = {"compile": torch.compile(self.ref, dynamic=False)}
        lig = _liger()
        if lig is not None:
            out["liger"] = lig.liger_rms_norm if self.op == "rms_norm" else lig.liger_layer_norm
        return out


class RopeCase:
    def __init__(self, B, Hq, Hkv, T, D, rdim):
        from lmkernels.ops.rope import rope_reference, rope_tables

        self.shape = (B, Hq, Hkv, T, D, rdim)
        g = torch.Generator(device=DEVICE).manual_seed(T + Hq)
        # ROOFLINE_ROPE_LAYOUT=bthd (roofline_tune.py --rope-layout): q, k and their gradients
        # as transposes of (B, T, H, D) memory, as transformers' attention passes them.
        bthd = os.environ.get("ROOFLINE_ROPE_LAYOUT") == "bthd"

        def x(H):
            if bthd:
                return torch.randn(B, T, H, D, device=DEVICE, generator=g).bfloat16().transpose(1, 2)
            return torch.randn(B, H, T, D, device=DEVICE, generator=g).bfloat16()

        self.q, self.k = x(Hq), x(Hkv)
        cos, sin = rope_tables(torch.arange(T), rdim or D, "neox")
        self.cos, self.sin = cos.to(DEVICE).bfloat16(), sin.to(DEVICE).bfloat16()
        self.rdim = rdim
        self.dq, self.dk = x(Hq), x(Hkv)
        self.ref = rope_reference
        self.bytes = 4 * (self.q.numel() + self.k.numel()) * E

    def run_full(self, fn):
        q, k = self.q.detach().requires_grad_(), self.k.detach().requires_grad_()

        def call():
            q.grad = k.grad = None
            qo, ko = fn(q, k)
            torch.autograd.backward((qo, ko), (self.dq, self.dk))

        return call, q, k

    def truth(self):
        if "_truth" not in self.__dict__:
            q, k = self.q.float().requires_grad_(), self.k.float().requires_grad_()
            qo, ko = self.ref(q, k, self.cos, self.sin, rotary_dim=self.rdim)
            torch.autograd.backward((qo, ko), (self.dq.float(), self.dk.float()))
            self.__dict__["_truth"] = [qo.detach(), ko.detach(), q.grad, k.grad]
            self.__dict__["eager_err"] = self.errors(
                lambda q, k: self.ref(q, k, self.cos, self.sin, rotary_dim=self.rdim)
            )
        return self.__dict__["_truth"]

    def errors(self, fn):
        from lmkernels.utils import poison_outputs

        q, k = self.q.detach().requires_grad_(), self.k.detach().requires_grad_()
        with poison_outputs():  # as NormCase.errors
            qo, ko = fn(q, k)
            torch.autograd.backward((qo, ko), (self.dq, self.dk))
        outs = [qo.detach(), ko.detach(), q.grad, k.grad]
        return [rel_err(o, t) for o, t in zip(outs, self.truth())]

    def check(self, fn):
        errs = self.errors(fn)
        for name, e, ee in zip(["q_out", "k_out", "dq", "dk"], errs, self.__dict__["eager_err"]):
            if not (e <= 2 * ee + 1e-3):
                return f"{name} rel err {e:.3g} > 2 x eager {ee:.3g} + 1e-3"
        return None

    def triton_fn(self):
        import lmkernels

        return lambda q, k: lmkernels.rope(q, k, self.cos, self.sin, rotary_dim=self.rdim, backend="triton")

    def peers(self):
        comp = torch.compile(self.ref, dynamic=False)
        out = {"compile": lambda q, k: comp(q, k, self.cos, self.sin, rotary_dim=self.rdim)}
        lig = _liger()
        if lig is not None and self.rdim is None:  # Liger rotates the whole head only
            out["liger"] = lambda q, k: lig.liger_rope(q, k, self.cos, self.sin)
        return out
