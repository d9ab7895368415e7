"""Host time per forward + backward with programmatic dependent launch on and off (GPU).

PDL adds a launch attribute (cuLaunchKernelEx) and a launch keyword to every Triton launch:
this measures what that costs the host, per op and shape, the two settings taking turns block
by block so that the host's drift falls on both alike (scripts/host_profile.per_call_us: 40
calls per block while a sleep kernel keeps the GPU busy; the best block of 20 counts).

    python scripts/pdl_host_ab.py --out DIR [--rounds 6] [--launch-only] [--cprofile OP]

The launches alone are measured first: an empty kernel with and without launch_pdl, and the
forward launchers of RMSNorm and RoPE.

Writes pdl_host_ab.json and pdl_host_ab.md (device, versions, command) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import DESIGN, SMALL, make_step  # noqa: E402
from host_profile import per_call_us, profile_top  # noqa: E402

from lmkernels.backends.triton import _common  # noqa: E402

OPS = ("rms_norm", "layer_norm", "rope", "swiglu")


@triton.jit
def _empty_kernel(a, b, c, d, n, BLOCK: tl.constexpr):
    pass


def launch_rows(rounds: int) -> list[dict]:
    """The launch alone: an empty kernel with and without the launch_pdl keyword, and the
    forward launchers of RMSNorm and RoPE (no autograd) at the small shapes."""
    from host_profile import launcher_fwd

    from lmkernels.registry import get_op

    a = torch.empty(64, device="cuda")
    calls = {
        "empty kernel": lambda on: (
            lambda: _empty_kernel[(1,)](a, a, a, a, 64, BLOCK=64, **({"launch_pdl": True} if on else {}))
        ),
    }
    for op in ("rms_norm", "rope"):
        inputs = get_op(op).make_inputs(SMALL[op], torch.bfloat16, "cuda", 0)
        launcher = launcher_fwd(op, inputs)
        calls[f"{op} forward launcher"] = lambda on, f=launcher: f
    rows = []
    for name, make in calls.items():
        best = {True: float("inf"), False: float("inf")}
        for _ in range(rounds):
            for on in (True, False):
                _common.USE_PDL = on
                best[on] = min(best[on], per_call_us(make(on)))
        _common.USE_PDL = True
        rows.append(dict(op=name, shapes="small", shape={}, pdl_us=best[True], no_pdl_us=best[False]))
        print(f"{name:24s} PDL {best[True]:6.1f} us   without {best[False]:6.1f} us", flush=True)
    return rows


def cprofile_tables(op: str, blocks: int = 10) -> str:
    """cProfile of `blocks` x 40 forward + backward steps of op at the small shape, PDL on and
    off: where the host time differs."""
    step = make_step(op, "triton", SMALL[op], torch.bfloat16)
    out = []
    for on in (True, False):
        _common.USE_PDL = on
        step()
        torch.cuda.synchronize()
        table = profile_top(step, blocks=blocks, lines=18).strip()
        out.append(f"## {op}, PDL {'on' if on else 'off'}\n\n```\n{table}\n```\n")
    _common.USE_PDL = True
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--launch-only", action="store_true", help="only the launches (launch_rows)")
    p.add_argument("--cprofile", metavar="OP", help="also write cprofile.md: OP's steps profiled")
    args = p.parse_args(argv)
    if args.cprofile:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cprofile.md").write_text(cprofile_tables(args.cprofile))
    rows = launch_rows(args.rounds)
    for op in () if args.launch_only else OPS:
        for name, shapes in (("small", SMALL), ("design", DESIGN)):
            step = make_step(op, "triton", shapes[op], torch.bfloat16)
            best = {True: float("inf"), False: float("inf")}
            for _ in range(args.rounds):
                for on in (True, False):
                    _common.USE_PDL = on
                    best[on] = min(best[on], per_call_us(step))
            _common.USE_PDL = True
            rows.append(dict(op=op, shapes=name, shape=shapes[op], pdl_us=best[True], no_pdl_us=best[False]))
            print(f"{op:10s} {name:6s} PDL {best[True]:6.1f} us   without {best[False]:6.1f} us", flush=True)
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        command="python scripts/pdl_host_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pdl_host_ab.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = ["# Host time per forward + backward, PDL on and off", ""]
    md += [f"- {k}: {v}" for k, v in meta.items()]
    md += ["", "| op | shapes | shape | PDL us | without us | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        shape = "x".join(str(v) for v in r["shape"].values()) or "-"
        ratio = r["pdl_us"] / r["no_pdl_us"]
        md.append(
            f"| {r['op']} | {r['shapes']} | {shape} | {r['pdl_us']:.1f} | {r['no_pdl_us']:.1f} | {ratio:.3f} |"
        )
    (out / "pdl_host_ab.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
