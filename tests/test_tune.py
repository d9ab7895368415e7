"""`lmkernels tune` on the CPU: its candidates and its report, its argument checks, and (under
the interpreter) candidates of each kind through the launchers."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from lmkernels import cli


def _tuner(monkeypatch):
    """`lmkernels tune`'s module and its candidates."""
    from lmkernels.harness.tune import candidates, norms

    return norms, candidates


def test_tuner_candidates_and_report(monkeypatch):
    tune, cand = _tuner(monkeypatch)
    for op in ("rms_norm", "layer_norm"):
        for n in (1024, 3584, 5120, 11008, 16384, 32768):
            fwd, bwd = cand.norm_fwd_candidates(n, op), cand.norm_bwd_candidates(n, op)
            assert fwd and bwd
            names = [cand.fwd_name(f) for f in fwd] + [cand.bwd_name(b) for b in bwd]
            assert len(set(names)) == len(names), (op, n)
            table = cand.tables().norms
            assert all(cand.norm_table_with(table, c) is not table for c in fwd + bwd)  # a valid table
    shape = [1, 32, 8, 4096, 128, None]
    rope = cand.rope_candidates(shape)
    assert len({cand.rope_name(c) for c in rope}) == len(rope)
    tile = next(c for c in rope if cand.rope_name(c) == "tile e1024 w2 p2048")
    meta = {"device": "GPU", "command": "tune", "torch": "2", "triton": "3", "copy_gbps": 4000.0}

    def row(op, shape, variant, ms, record):
        config = cand.as_json(record)
        return {"op": op, "shape": shape, "variant": variant, "kind": "triton", "status": "ok", "ms": ms,
                "config": config, "pct_copy": 80.0}  # fmt: skip

    rows = [row("rope", shape, "table", 1.0, None), row("rope", shape, cand.rope_name(tile), 0.9, tile)]
    md = tune.markdown(rows, meta)
    assert "| rope | 1x32x8x4096x128 | 1.0000 |" in md
    assert "RopeTileConfig(\n            half=64,\n            tile_elements=1024,\n" in md
    assert 'why="fwd+bwd 1.11x the entry it replaces (1 shape)",' in md
    json.dumps(rows)

    # Norms: the entry of the key's points (two widths of one entry) timed at both, with the
    # forward of the fastest forward candidate and the backward of the fastest backward one.
    base = cand.base_entry(cand.tables().norms, "rms_norm", 4096)
    fwd = next(f for f in cand.norm_fwd_candidates(4096, "rms_norm") if f.fwd_warps != base.fwd_warps)
    bwd = next(b for b in cand.norm_bwd_candidates(4096, "rms_norm") if b.stages == base.stages + 1)
    rows = []
    for M, table_ms in ((16384, 1.0), (65536, 4.0)):
        point = [row("rms_norm", [M, 4096], "table", table_ms, base)]
        point += [row("rms_norm", [M, 4096], cand.fwd_name(fwd), table_ms * 0.95, fwd)]
        point += [row("rms_norm", [M, 4096], cand.bwd_name(bwd), table_ms * 0.9, bwd)]
        tuned = tune.tuned_entry(point, base)
        assert (tuned.fwd_warps, tuned.stages) == (fwd.fwd_warps, bwd.stages)
        rows += point + [row("rms_norm", [M, 4096], "tuned", table_ms * 0.8, tuned)]
    rows.append(
        row("rms_norm", [16384, 4096], "bwd one point only", 0.5, dataclasses.replace(bwd, bwd_warps=32))
    )
    md = tune.markdown(rows, meta)
    assert f"bwd_warps={base.bwd_warps}," in md and "cols=(3073, 4096)," in md
    assert f"fwd_warps={fwd.fwd_warps}," in md and f"stages={bwd.stages}," in md
    assert 'why="fwd+bwd 1.25x the entry it replaces (2 shapes)",' in md
    assert "bwd_warps=32," not in md  # timed at one of the key's points only
    assert tune.tuned_entry(rows[:2], base) is None  # one half improved: a candidate already timed


def test_tune_cli_errors_name_the_argument(capsys):
    """`lmkernels tune`: a typo names the option and the known values; no GPU is one line."""
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--out", "x", "--ops", "rmsnorm"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--ops: unknown op 'rmsnorm' (did you mean" in err and "Traceback" not in err
    assert cli.main(["tune", "--out", "x", "--ops", "rms_norm", "--grid", "tiles"]) == 2
    assert "--grid tiles has no points for rms_norm" in " ".join(capsys.readouterr().err.split())
    if not __import__("torch").cuda.is_available():
        assert cli.main(["tune", "--out", "x"]) == 2
        assert "on a CUDA GPU; none is visible here" in " ".join(capsys.readouterr().err.split())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter")
@pytest.mark.triton
def test_tuner_runs_candidates_through_the_launchers(monkeypatch):
    """Each kind of candidate, passed to the launchers, matches the fp32 reference (the
    interpreter on the CPU)."""
    tune, cand = _tuner(monkeypatch)
    for op, shape in (("rms_norm", (4, 1024)), ("layer_norm", (4, 1024)), ("rope", (1, 4, 2, 16, 64, None))):
        case = tune.Case(op, shape)
        named = dict(cand.variants(op, case, table_only=False)[1:])
        kinds = ("fwd", "bwd") if op != "rope" else ("tile", "pos")
        for kind in kinds:
            name = next(n for n in named if n.startswith(kind))
            assert case.check(case.launch(named[name])) is None, (op, name)
    assert case.check(lambda q, k: (q * 1.01, k)) is not None  # the check can fail


def test_tuned_tables_hold_the_winners_and_load_back(monkeypatch, tmp_path):
    """The winners of a run in the place of the entries they beat: the tables `--install` writes,
    a file that loads back for the GPU (configs.files)."""
    tune, cand = _tuner(monkeypatch)
    from lmkernels.backends.triton.configs import files

    meta = {"device": "GPU", "command": "lmkernels tune --out x --install"}
    base = cand.base_entry(cand.tables().norms, "rms_norm", 4096)
    bwd = next(b for b in cand.norm_bwd_candidates(4096, "rms_norm") if b.stages == base.stages + 1)
    shape = [1, 32, 8, 4096, 64, None]  # D = 64: the table's tile entry for half 32
    pos = cand.rope_pos_entry(cand.tables().rope, shape)
    rows = []
    for variant, record, ms in (("table", base, 1.0), (cand.bwd_name(bwd), bwd, 0.9)):
        rows.append({"op": "rms_norm", "shape": [16384, 4096], "variant": variant, "kind": "triton",
                     "status": "ok", "ms": ms, "config": cand.as_json(record)})  # fmt: skip
    for variant, record, ms in (("table", None, 1.0), ("pos table", pos, 0.8)):
        rows.append({"op": "rope", "shape": shape, "variant": variant, "kind": "triton", "status": "ok",
                     "ms": ms, "config": cand.as_json(record)})  # fmt: skip
    found = [w for w in tune.winners(rows) if w.record is not None]
    assert len(found) == 2
    before = cand.tables()
    tables = tune.tuned_tables(before, found, "tuned GPU")
    entry = tables.norms.entry("rms_norm", 4096)
    assert entry.stages == bwd.stages and entry.why == "fwd+bwd 1.11x the entry it replaces (1 shape)"
    assert before.rope.tile_config(32, False) is not None and tables.rope.tile_config(32, False) is None
    assert tables.rope.position_config(32, False).why == "fwd+bwd 1.25x the entry it replaces (1 shape)"
    identity = files.DeviceIdentity("NVIDIA GeForce RTX 4090", "sm_89", "3.9.0")
    path = files.write_tuned(tables, identity, tmp_path, meta["command"])
    back = files.load_tuned(identity, tmp_path)
    assert back.norms.entry("rms_norm", 4096) == entry and back.name == "tuned GPU"
    assert path.name == identity.filename
