"""GPUs beyond Hopper, on the CPU: the targets' limits, the generic rule that fits Hopper's
tables to them, which tables a device gets (tuned file, Hopper's, generic), the tuned-tables
files (written, loaded back, stale or foreign ones ignored with a warning), launching as another
GPU would (simulate), and the GPU rules of the Triton impls (no bf16 on sm_75; `auto` passing over
Triton where the generic tables were measured slower than compile)."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket

import pytest
import torch

configs = pytest.importorskip("lmkernels.backends.triton.configs", reason="needs triton")
from lmkernels.backends.triton.configs import files, generic, hopper, records, targets  # noqa: E402
from lmkernels.backends.triton.configs.targets import CHECKED, TARGETS  # noqa: E402


def _entries(tables):
    n, r = tables.norms, tables.rope
    return [*n.entries, n.wide, n.column, n.sums, *r.position, *r.tile, *tables.flce.rows]


def _warps(record):
    return [getattr(record, f) for f in ("fwd_warps", "bwd_warps", "num_warps") if hasattr(record, f)]


# --- the targets and the generic rule -------------------------------------------------------------


def test_targets_hold_the_documented_limits():
    kib = {name: t.shared_per_block // 1024 for name, t in TARGETS.items()}
    assert kib == {"sm_75": 64, "sm_80": 163, "sm_86": 99, "sm_89": 99, "sm_90": 227, "sm_100": 227,
                   "sm_120": 99, "gfx942": 64}  # fmt: skip
    assert [n for n, t in TARGETS.items() if not t.bf16] == ["sm_75"]
    assert [n for n, t in TARGETS.items() if t.sm90_ptx] == ["sm_90", "sm_100", "sm_120"]
    assert TARGETS["gfx942"].max_warps == 16 and TARGETS["sm_80"].max_warps == 32
    assert targets.target("8.6") is targets.target("86") is targets.target("SM86") is TARGETS["sm_86"]
    with pytest.raises(KeyError, match="unknown target"):
        targets.target("sm_11")
    # The register file: 1024 threads of 64 registers fill an NVIDIA SM; AMD spreads 16 wavefronts
    # over 4 SIMDs of 512 registers per lane.
    sm80, mi300 = TARGETS["sm_80"], TARGETS["gfx942"]
    assert sm80.registers_fit(1024, 64) and not sm80.registers_fit(1024, 65)
    assert sm80.registers_fit(256, 255) and not sm80.registers_fit(512, 129)
    assert mi300.registers_fit(1024, 128) and not mi300.registers_fit(1024, 129)
    assert mi300.registers_fit(256, 512)


@pytest.mark.parametrize("name", CHECKED)
def test_generic_tables_fit_each_target(name):
    t = TARGETS[name]
    tables = configs.target_tables(t)
    for e in _entries(tables):
        assert all(w * t.warp_size <= t.max_threads_per_block for w in _warps(e)), e
        assert e.why
    for e in tables.norms.entries:
        cols = generic._bwd_cols(e)
        stage = generic.norm_stage_bytes(1, cols, 2, 2 if e.reload_w else 0, e.reload_x and not e.hold_x)
        assert (e.stages - 1) * stage <= t.shared_per_block - generic.SHARED_MARGIN, e
        assert not e.prefetch or t.sm90_ptx
    assert tables.name == ("hopper" if name == "sm_90" else f"generic {name}")


def test_generic_rule_keeps_hoppers_entries_where_they_fit():
    """B200 has Hopper's limits: Hopper's launches, entry for entry (their `why` says so)."""
    same = generic.tables_for_target(TARGETS["sm_100"])
    for a, b in zip(_entries(same), _entries(hopper.TABLES)):
        assert dataclasses.replace(a, why="") == dataclasses.replace(b, why=""), (a, b)
        assert "unchanged" in a.why and b.why in a.why
    assert configs.target_tables(TARGETS["sm_90"]) is hopper.TABLES


def test_generic_rule_on_small_shared_memory_and_wide_wavefronts():
    hop = {(e.op, e.cols): e for e in hopper.NORMS.entries}
    ada = {(e.op, e.cols): e for e in generic.tables_for_target(TARGETS["sm_89"]).norms.entries}
    e = ada[("layer_norm", (4097, 6144))]  # 5 stages of 8192 bf16 columns: 96 KiB of the 99
    assert hop[e.op, e.cols].stages == 5 and e.stages == 3 and "stages 5 -> 3" in e.why
    assert all(not x.prefetch for x in ada.values())  # sm_89 runs no sm_90 PTX
    mi300 = generic.tables_for_target(TARGETS["gfx942"])
    assert mi300.flce.rows_launch(128256) == (32768, 16)  # Hopper's 32 warps: 2048 threads
    e = {(x.op, x.cols): x for x in mi300.norms.entries}[("rms_norm", (12289, 16384))]
    assert (e.fwd_warps, e.bwd_warps) == (16, 8)  # Hopper's 1024 and 512 threads
    assert generic.warps_for(1, TARGETS["gfx942"]) == 1


# --- which tables a device gets --------------------------------------------------------------------


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """tables_for's view of CUDA devices 0-3 (sm_90, sm_80, sm_89, sm_75), their names and a
    folder of tuned files, without a GPU."""
    import lmkernels.backends.triton as triton_pkg

    names = {
        0: "NVIDIA H100 80GB HBM3",
        1: "NVIDIA A100-SXM4-80GB",
        2: "NVIDIA GeForce RTX 4090",
        3: "Tesla T4",
    }
    arch = {0: "sm_90", 1: "sm_80", 2: "sm_89", 3: "sm_75"}
    monkeypatch.setattr(configs, "_BY_DEVICE", {})
    monkeypatch.setattr(triton_pkg, "interpreting", lambda: False)
    monkeypatch.setattr(targets, "device_target", lambda index: TARGETS[arch[index]])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: names[index])
    monkeypatch.setattr(
        files, "identity_of", lambda index: files.DeviceIdentity(names[index], arch[index], "3.9.0")
    )
    monkeypatch.setenv(files.ENV, str(tmp_path))
    monkeypatch.setattr(files, "_WARNED", set())
    return names


def _tuned(base, why="measured 1.10x"):
    """base with one norm entry's stages changed, as `lmkernels tune --install` writes a winner."""
    e = base.norms.entries[0]
    entry = dataclasses.replace(e, stages=2, why=why)
    norms = dataclasses.replace(base.norms, entries=(entry, *base.norms.entries[1:]))
    return dataclasses.replace(base, name="tuned NVIDIA A100-SXM4-80GB", norms=norms)


def test_devices_get_hopper_generic_or_tuned_tables(fake_gpus, tmp_path):
    names = [configs.tables_for(torch.device("cuda", i)).name for i in range(4)]
    assert names == ["hopper", "generic sm_80", "generic sm_89", "generic sm_75"]
    assert configs.tables_for(torch.device("cpu")) is configs.default.TABLES
    tuned = _tuned(configs.target_tables(TARGETS["sm_80"]))
    path = files.write_tuned(tuned, files.identity_of(1), command="lmkernels tune --out x --install")
    assert path == tmp_path / "nvidia-a100-sxm4-80gb-sm_80-triton3.9.0-v1.json"
    configs._BY_DEVICE.clear()
    loaded = configs.tables_for(torch.device("cuda", 1))
    assert loaded.name == tuned.name and loaded.norms.entries == tuned.norms.entries
    assert _entries(loaded) == _entries(tuned) and configs.is_tuned(loaded)
    assert configs.tables_for(torch.device("cuda", 2)).name == "generic sm_89"  # another GPU's file


def test_tuned_file_round_trip_and_format(fake_gpus, tmp_path):
    identity = files.identity_of(2)
    tables = _tuned(configs.target_tables(TARGETS["sm_89"]))
    path = files.write_tuned(tables, identity, command="lmkernels tune --out x --install")
    content = json.loads(path.read_text())
    assert content["schema"] == files.SCHEMA and content["triton"] == "3.9.0"
    assert content["device"] == {"name": "NVIDIA GeForce RTX 4090", "arch": "sm_89"}
    assert content["tables"]["norms"]["entries"][0]["cols"] == list(tables.norms.entries[0].cols)
    back = files.load_tuned(identity)
    assert _entries(back) == _entries(tables)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "lmkernels" and r.levelno == logging.WARNING]


def test_stale_and_foreign_files_are_ignored_with_a_warning(fake_gpus, tmp_path, caplog):
    identity = files.identity_of(1)
    tables = _tuned(configs.target_tables(TARGETS["sm_80"]))
    path = files.write_tuned(tables, identity)
    content = json.loads(path.read_text())
    caplog.set_level(logging.INFO, logger="lmkernels")

    def load_with(change, name=None):
        target = tmp_path / (name or path.name)
        target.write_text(json.dumps(change(json.loads(json.dumps(content)))))
        caplog.clear()
        files._WARNED.clear()
        return files.load_tuned(identity)

    assert load_with(lambda c: c) is not None and not _warnings(caplog)
    assert load_with(lambda c: c | {"triton": "3.6.0"}) is None
    assert "stale: tuned with triton 3.6.0, this is triton 3.9.0" in _warnings(caplog)[0]
    assert load_with(lambda c: c | {"schema": 0}) is None
    assert "stale: schema 0" in _warnings(caplog)[0]
    assert load_with(lambda c: c | {"device": {"name": "NVIDIA A100-PCIE-40GB", "arch": "sm_80"}}) is None
    assert "from another GPU: NVIDIA A100-PCIE-40GB" in _warnings(caplog)[0]
    assert "lmkernels tune --out DIR --install" in _warnings(caplog)[0]
    # A file for another Triton version only (its own name): stale, said once, nothing loaded.
    path.rename(tmp_path / identity.filename.replace("3.9.0", "3.6.0"))
    caplog.clear()
    files._WARNED.clear()
    assert files.load_tuned(identity) is None
    assert "stale" in _warnings(caplog)[0] and "triton3.6.0" in _warnings(caplog)[0]
    configs._BY_DEVICE.clear()
    assert configs.tables_for(torch.device("cuda", 1)).name == "generic sm_80"


@pytest.mark.parametrize(
    "change, error",
    [
        (
            lambda t: t["norms"]["entries"][0].update(stagez=2),
            r"tables.norms.entries\[0\]: NormEntry has no field stagez",
        ),
        (
            lambda t: t["norms"]["entries"][0].update(stages="2"),
            r"entries\[0\].stages: int expected, got '2'",
        ),
        (lambda t: t["norms"]["entries"][0].update(hold_x=1), r"hold_x: bool expected, got 1"),
        (lambda t: t["norms"]["entries"][0].update(cols=[513]), r"cols: 2 values expected, got 1"),
        (lambda t: t["norms"]["entries"][0].pop("fwd_warps"), r"NormEntry needs fwd_warps"),
        (lambda t: t["norms"]["entries"][0].update(cols=[400, 1024]), r"not a range within one power-of-two"),
        (lambda t: t["flce"]["rows"][0].update(block=3000), r"power-of-2 block"),
        (lambda t: t["rope"]["position"][0].update(block_half="32"), r"block_half"),
        (lambda t: t.update(extra=1), r"Tables has no field extra"),
    ],
    ids=["unknown", "type", "bool", "tuple", "missing", "rule", "flce-rule", "optional", "top"],
)
def test_malformed_tables_are_refused_naming_the_field(change, error):
    obj = files.tables_to_json(hopper.TABLES)
    assert files.tables_from_json(json.loads(json.dumps(obj))).norms.entries == hopper.NORMS.entries
    change(obj)
    with pytest.raises(files.ConfigFileError, match=error):
        files.tables_from_json(obj)


def test_config_dir_and_file_names(monkeypatch, tmp_path):
    monkeypatch.delenv(files.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert files.config_dir() == tmp_path / "lmkernels" / "configs"
    monkeypatch.setenv(files.ENV, "")
    assert files.config_dir() is None  # set empty: no file is loaded
    identity = files.DeviceIdentity("NVIDIA GeForce RTX 4090", "sm_89", "3.9.0")
    assert files.config_path(identity) is None and files.load_tuned(identity) is None
    assert identity.filename == "nvidia-geforce-rtx-4090-sm_89-triton3.9.0-v1.json"


# --- launching as another GPU would -----------------------------------------------------------------


def test_simulate_switches_the_launch_time_choices():
    from lmkernels.backends.triton import common, norms

    x = torch.zeros(4, 16384, dtype=torch.bfloat16)
    assert common.soft_bf16(x) and common.pdl(x) == {"PDL": False}
    with targets.simulate(TARGETS["sm_86"], compiled=True):
        assert configs.tables_for(x.device).name == "generic sm_86"
        assert not common.soft_bf16(x) and common.pdl(x) == {"PDL": False}
        cfg = norms.bwd_config(hopper.NORMS, "layer_norm", 6144)  # Hopper's 5 stages
        assert norms.pipeline_stages(cfg, x, x[0]) == 3  # 2 x 48 KiB (8192 columns) of 99 KiB
        assert norms.pipeline_stages(cfg, x.float(), x[0].float()) == 2
    with targets.simulate(TARGETS["sm_90"], compiled=True):
        assert common.pdl(x) == {"PDL": True, "launch_pdl": True} or not common._TRITON_PDL
        assert norms.can_prefetch(dataclasses.replace(cfg, prefetch=True), x)
    with targets.simulate(TARGETS["sm_90"]):  # kernels run here (the interpreter): its own choices
        assert common.soft_bf16(x) and common.pdl(x) == {"PDL": False}
        assert configs.tables_for(x.device) is hopper.TABLES
    assert configs.tables_for(x.device) is configs.default.TABLES and targets.ACTIVE is None


# --- the GPU rules of the Triton impls ----------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch, fake_gpus):
    """Fake CUDA tensors (FakeTensorMode) and a Triton backend that reports itself available."""
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    import lmkernels  # noqa: F401
    from lmkernels.registry import impls

    for impl in impls("rms_norm"):
        monkeypatch.setitem(impl.__dict__, "_availability", None)
        monkeypatch.setattr(impl, "devices", ("cuda", "cpu"))
    # FakeTensorMode makes a real tensor on each fake CUDA device it sees first; on a GPU machine
    # the fake devices 1-3 may not exist.
    monkeypatch.setattr(fake_tensor, "init_gpu_context", lambda device: None)
    mode = FakeTensorMode()

    def make(index, dtype):
        with mode:
            x = torch.empty(8, 64, device=f"cuda:{index}", dtype=dtype)
            return {"x": x, "weight": torch.empty(64, device=f"cuda:{index}", dtype=dtype)}

    return make


def test_no_bf16_on_sm75_auto_picks_another(fake_cuda, monkeypatch):
    from lmkernels.registry import BackendNotSupportedError
    from lmkernels.registry.dispatch import resolve

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    on_t4 = fake_cuda(3, torch.bfloat16)
    assert resolve("rms_norm", on_t4).backend != "triton"
    with pytest.raises(
        BackendNotSupportedError, match=r"x: bf16 on sm_75 \(T4, RTX 20xx\), which has no bf16"
    ):
        resolve("rms_norm", on_t4, backend="triton")
    assert resolve("rms_norm", fake_cuda(3, torch.float16)).backend == "triton"
    assert resolve("rms_norm", fake_cuda(1, torch.bfloat16)).backend == "triton"  # A100


def test_auto_prefers_compile_where_generic_tables_measured_slower(fake_cuda, monkeypatch):
    from lmkernels.registry.dispatch import explain, resolve

    monkeypatch.setattr(generic, "PREFER_COMPILE", {"sm_80": frozenset({"rms_norm"})})
    on_a100 = fake_cuda(1, torch.bfloat16)
    assert resolve("rms_norm", on_a100).backend == "compile"
    assert resolve("rms_norm", on_a100, backend="triton").backend == "triton"  # asked for: runs
    reasons = dict((b, r) for b, _, r in explain("rms_norm", on_a100).rows)["triton"]
    assert "generic launch tables, measured slower than compile" in reasons[0]
    assert resolve("rms_norm", fake_cuda(0, torch.bfloat16)).backend == "triton"  # Hopper: tuned
    configs._BY_DEVICE[torch.device("cuda", 1)] = _tuned(configs.target_tables(TARGETS["sm_80"]))
    assert resolve("rms_norm", on_a100).backend == "triton"  # a tuned file: measured here
    assert records.NORM_OPS  # (records imported for the tables' types)


def test_gpu_checks_are_constants_to_torch_compile(fake_gpus, monkeypatch):
    """The dispatch checks the GPU (bf16, generic tables slower than compile) while torch.compile
    traces a Triton op; the device's properties and Triton's driver cannot be traced, and a
    fullgraph compile of any Triton op on a GPU failed at that check."""
    from lmkernels.backends.triton import common

    def untraceable(index):
        socket.gethostname()  # a C function dynamo cannot trace, as the driver's calls
        return TARGETS[{0: "sm_90", 3: "sm_75"}[index]]

    monkeypatch.setattr(targets, "device_target", untraceable)
    monkeypatch.setattr(generic, "PREFER_COMPILE", {"sm_75": frozenset({"rms_norm"})})
    with pytest.raises(Exception, match="gethostname"):  # the check can fail
        torch.compile(lambda x: x + len(targets.device_target(0).name), fullgraph=True, backend="eager")(
            torch.zeros(1)
        )
    torch._dynamo.reset()

    def checks(x):
        return (
            x
            + len(common.no_bf16(0))
            + 10 * len(common.no_bf16(3))
            + 1000 * len(common.generic_slower("rms_norm", 3))
        )

    expected = checks(torch.zeros(1))
    assert expected.item() == 10 * len("sm_75 (T4, RTX 20xx)") + 1000 * len("sm_75")
    assert torch.equal(torch.compile(checks, fullgraph=True, backend="eager")(torch.zeros(1)), expected)
