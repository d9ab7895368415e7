"""Host time per forward + backward with programmatic dependent launch on and off (GPU).

PDL adds a launch attribute (cuLaunchKernelEx) and a launch keyword to every Triton launch:
this measures what that costs the host, per op and shape, the two settings taking turns block
by block so that the host's drift falls on both alike (scripts/host_profile.per_call_us: 40
calls per block while a sleep kernel keeps the GPU busy; the best block of 20 counts).

    python scripts/pdl_host_ab.py --out DIR [--rounds 6]

Writes pdl_host_ab.json and pdl_host_ab.md (device, versions, command) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import DESIGN, SMALL, make_step  # noqa: E402
from host_profile import per_call_us  # noqa: E402

from lmkernels.backends.triton import _common  # noqa: E402

OPS = ("rms_norm", "layer_norm", "rope", "swiglu")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    rows = []
    for op in OPS:
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
        shape = "x".join(str(v) for v in r["shape"].values())
        ratio = r["pdl_us"] / r["no_pdl_us"]
        md.append(
            f"| {r['op']} | {r['shapes']} | {shape} | {r['pdl_us']:.1f} | {r['no_pdl_us']:.1f} | {ratio:.3f} |"
        )
    (out / "pdl_host_ab.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
