"""The tuned tables as data (backends/triton/configs): which generation a device gets, that
the tables are well formed and say why, and that `entry_text` writes entries as hopper.py holds
them."""

import dataclasses
import inspect

import pytest
import torch

configs = pytest.importorskip("lmkernels.backends.triton.configs", reason="needs triton")
from lmkernels.backends.triton.configs import default, hopper, records  # noqa: E402
from lmkernels.backends.triton.configs.entry_text import entry_text  # noqa: E402


def _all_entries(tables):
    n, r = tables.norms, tables.rope
    return [*n.entries, n.wide, n.column, n.sums, *r.position, *r.tile, *tables.flce.rows]


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """tables_for's view of CUDA devices of given targets (no GPU needed; no tuned files)."""
    import lmkernels.backends.triton as triton_pkg
    from lmkernels.backends.triton.configs import files, targets

    monkeypatch.setattr(configs, "_BY_DEVICE", {})
    monkeypatch.setattr(triton_pkg, "interpreting", lambda: False)
    monkeypatch.setenv(files.ENV, str(tmp_path))
    asked = []
    names = {0: "sm_90", 1: "sm_80", 2: "sm_100", 3: "sm_120", 4: "gfx942"}

    def device_target(index):
        asked.append(index)
        return targets.TARGETS[names[index]]

    monkeypatch.setattr(targets, "device_target", device_target)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"GPU {index}")
    monkeypatch.setattr(files, "identity_of", lambda i: files.DeviceIdentity(f"GPU {i}", names[i], "3.9.0"))
    return asked


def test_hopper_tables_on_sm90_only(gpu, monkeypatch):
    names = [configs.tables_for(torch.device("cuda", i)).name for i in range(5)]
    # H100/H200; A100, B200, consumer Blackwell and MI300 get Hopper's entries within their limits
    assert names == ["hopper", "generic sm_80", "generic sm_100", "generic sm_120", "generic gfx942"]
    assert configs.tables_for(torch.device("cpu")) is default.TABLES
    configs.tables_for(torch.device("cuda", 0))
    assert gpu == [0, 1, 2, 3, 4]  # once per device


def test_interpreter_and_cpu_get_the_default_tables():
    assert configs.tables_for(torch.device("cpu")) is default.TABLES


def test_default_entries_are_hoppers():
    """The interpreter runs Hopper's entries (FLCE's rows: one launch for every width)."""
    assert default.TABLES.norms is hopper.TABLES.norms and default.TABLES.rope is hopper.TABLES.rope
    assert [e.min_cols for e in default.TABLES.flce.rows] == [1]
    assert default.TABLES.flce.rows_launch(128256) == hopper.FLCE.rows_launch(4096) == (4096, 8)
    assert "interpreter" in default.__doc__


def test_every_entry_says_why_with_a_number_and_no_history():
    for e in _all_entries(hopper.TABLES):
        if isinstance(e, records.ColumnConfig):
            continue  # the one setting kept without a recorded ratio (its why says so)
        assert any(c.isdigit() for c in e.why), e
    text = inspect.getsource(hopper)
    for word in ("session", "results/", "2026-", "benchmarks/"):
        assert word not in text.lower(), word


def test_flce_rows_launch_by_width():
    """The widest entry a row reaches decides; the block never passes the row's power of 2,
    and a block under 2048 runs 4 warps."""
    table = records.FlceTable(
        rows=(
            records.FlceRowsEntry(min_cols=1, block=4096, num_warps=8, why="1"),
            records.FlceRowsEntry(min_cols=65536, block=32768, num_warps=32, why="2"),
        )
    )
    assert table.rows_launch(128256) == (32768, 32)
    assert table.rows_launch(65536) == (32768, 32)
    assert table.rows_launch(65535) == (4096, 8)
    assert table.rows_launch(3000) == (4096, 8)
    assert table.rows_launch(1000) == (1024, 4)
    assert table.rows_launch(1) == (1, 4)
    assert table.rows_launch(0) == (1, 4)  # an empty vocabulary shard
    with pytest.raises(ValueError, match="min_cols 1"):
        records.FlceTable(rows=(records.FlceRowsEntry(min_cols=2, block=4096, num_warps=8, why="1"),))
    with pytest.raises(ValueError, match="one entry per min_cols"):
        records.FlceTable(
            rows=(*table.rows, records.FlceRowsEntry(min_cols=1, block=2048, num_warps=8, why="3"))
        )
    with pytest.raises(ValueError, match="power-of-2"):
        records.FlceRowsEntry(min_cols=1, block=3000, num_warps=8)
    # Hopper's own: a full Llama 3 row takes the wide launch, a tensor-parallel half row the narrow
    assert hopper.FLCE.rows_launch(128256) == (32768, 32)
    assert hopper.FLCE.rows_launch(64128) == (4096, 8)


@pytest.mark.parametrize("op", records.NORM_OPS)
def test_norm_entries_serve_each_width_once(op):
    """The entries' row widths tile 513-16384 (a block's rows from half of it up), no gaps."""
    table = hopper.TABLES.norms
    served = sorted(e.cols for e in table.entries if e.op == op)
    assert served[0][0] == 513 and served[-1][1] == table.max_fused_n
    for (_, last), (first, _) in zip(served, served[1:]):
        assert first == last + 1
    assert table.entry(op, 512) is None and table.entry(op, table.max_fused_n + 1) is None
    assert table.entry(op, 5120).cols[0] <= 5120 <= table.entry(op, 5120).cols[1]


def test_records_refuse_what_no_kernel_runs():
    base = dict(op="rms_norm", cols=(4097, 5120), fwd_warps=8, bwd_warps=8, programs_per_sm=1, why="x 1.0x")
    records.NormEntry(**base)
    with pytest.raises(ValueError, match="one power-of-two block"):
        records.NormEntry(**{**base, "cols": (4000, 5000)})
    with pytest.raises(ValueError, match="RMSNorm only"):
        records.NormEntry(**{**base, "op": "layer_norm", "hold_x": True})
    with pytest.raises(ValueError, match="LayerNorm only"):
        records.NormEntry(**{**base, "fma": True})
    norms = hopper.TABLES.norms
    overlap = (*norms.entries, records.NormEntry(**{**base, "cols": (5000, 6000)}))
    with pytest.raises(ValueError, match="overlap"):
        dataclasses.replace(norms, entries=overlap)
    with pytest.raises(ValueError, match="without a `why`"):
        rope = hopper.TABLES.rope
        tile = (*rope.tile, records.RopeTileConfig(half=8, tile_elements=1024, num_warps=2, min_programs=1))
        records.Tables(name="x", norms=norms, rope=dataclasses.replace(rope, tile=tile), flce=hopper.FLCE)


def _key_and_fields(e):
    keys = {"op", "cols", "why", "block_half", "half"}
    fields = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name not in keys}
    if isinstance(e, records.NormEntry):
        return e.op, e.cols[1], fields
    if isinstance(e, records.RopePosConfig):
        return "rope_position", e.block_half, fields
    return "rope_tile", e.half, fields


def test_entry_text_writes_the_entries_hopper_holds():
    """Every keyed entry of hopper.py is, character for character, what entry_text writes for
    its fields: the module is in the form the tuner produces, and its text evaluates back to
    the same record."""
    text = inspect.getsource(hopper)
    entries = [*hopper.NORMS.entries, *hopper.ROPE.tile]
    entries += [e for e in hopper.ROPE.position if e.block_half is not None]
    for e in entries:
        op, width, fields = _key_and_fields(e)
        written = entry_text(op, width, fields, e.why)
        assert written in text, written
        assert eval(written.strip().rstrip(","), vars(records)) == e


def test_entry_text_from_a_measured_winner():
    written = entry_text(
        "rms_norm", 5000, {"fwd_warps": 8, "bwd_warps": 4, "programs_per_sm": 2}, "4 warps: 1.05x"
    )
    assert written.splitlines() == [
        "        NormEntry(",
        '            op="rms_norm",',
        "            cols=(4097, 5120),",  # the range of the entry it replaces
        "            fwd_warps=8,",
        "            bwd_warps=4,",
        "            programs_per_sm=2,",
        '            why="4 warps: 1.05x",',
        "        ),",
    ]
    # A width no entry serves: the upper half of its block.
    assert "cols=(257, 512)," in entry_text("layer_norm", 300, {"fwd_warps": 4, "bwd_warps": 4,
                                                                "programs_per_sm": 8}, "new: 1.1x")  # fmt: skip
    tile = entry_text("rope_tile", 24, {"partial": True, "tile_elements": 1024, "num_warps": 2,
                                        "min_programs": 2048}, "D = 64, half 24: 1.1x")  # fmt: skip
    assert "half=24," in tile and "partial=True," in tile
    assert "block_half=64," in entry_text("rope_position", 40, {"tile_elements": 1024, "num_warps": 2,
                                                                "min_programs": 8192}, "1.1x")  # fmt: skip


_WINNER = {"fwd_warps": 8, "bwd_warps": 4, "programs_per_sm": 1}


@pytest.mark.parametrize(
    "op, fields, why, error",
    [
        ("rms_norm", {**_WINNER, "bwd_warp": 4}, "1.1x", "no field bwd_warp"),
        ("rms_norm", {**_WINNER, "fma": True}, "1.1x", "LayerNorm"),
        ("rms_norm", {"fwd_warps": 8, "programs_per_sm": 1}, "1.1x", "bwd_warps"),
        ("rms_norm", _WINNER, "", "one non-empty line"),
        ("rms_norm", _WINNER, "a\nb", "one non-empty line"),
        ("rms_norm", _WINNER, "x" * 100, "too long"),
        ("swiglu", {}, "1.1x", "one of"),
    ],
    ids=["misnamed", "rule", "missing", "no-why", "two-lines", "long-why", "op"],
)
def test_entry_text_refuses_bad_entries(op, fields, why, error):
    with pytest.raises((ValueError, TypeError), match=error):
        entry_text(op, 5000, fields, why)
