"""The GPUs the Triton kernels are built for, as data: a `Target` holds what the launch
configurations must fit (shared memory per block, threads, registers, the wavefront width) and
what the launchers switch on (bf16, sm_90 PTX), so that the tables of any GPU can be derived
(configs.generic) and every launch compiled for it offline (lmkernels.harness.targets) without
the GPU.

`TARGETS`: the GPU generations the offline checks cover, with their documented limits.
`device_target(index)`: the target of a live CUDA / ROCm device, read from its properties.
`simulate(target)`: while it is active, the launchers make their launch-time choices (tables,
programmatic dependent launch, the L2 prefetch, pipeline stages, bf16 rounding) for `target`
instead of the device the tensors are on: how the offline compile check records the launches
a GPU would make, and how the maintainers' suite times one GPU's configurations on another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmkernels.backends.triton.configs.records import Tables


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """One GPU generation, what its kernels' launches must fit.

    name: "sm_80" (NVIDIA: compute capability 8.0), "gfx942" (AMD: the LLVM target).
    backend: "cuda" or "hip" (Triton's backend names).
    arch: Triton's: the capability as an int (80) for CUDA, the gfx name for HIP.
    warp_size: threads per warp (32) or wavefront (64 on AMD Instinct).
    shared_per_block: bytes of shared memory (LDS) one block may use, opted in.
    shared_per_sm: bytes per SM (CU): what blocks resident together share.
    max_threads_per_block, max_threads_per_sm: threads of a block, of the blocks resident on an SM.
    registers_per_sm: 32-bit registers per SM (per CU on AMD: 4 SIMDs x 512 VGPRs x 64 lanes).
    max_registers_per_thread: 255 on NVIDIA; 512 on CDNA3 (256 VGPRs + 256 AGPRs).
    register_granule: registers per thread are allocated in multiples of this (8 on NVIDIA).
    bf16: whether the GPU has bf16 arithmetic (sm_80 and later; CDNA2 and later).
    gpus: the cards, in words.
    """

    name: str
    backend: str
    arch: int | str
    warp_size: int
    shared_per_block: int
    shared_per_sm: int
    max_threads_per_block: int = 1024
    max_threads_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int
    register_granule: int = 8
    bf16: bool
    gpus: str = ""

    def __post_init__(self) -> None:
        if self.backend not in ("cuda", "hip"):
            raise ValueError(f"Target.backend: {self.backend!r}, not 'cuda' or 'hip'")
        if self.backend == "cuda" and not isinstance(self.arch, int):
            raise ValueError(
                f"Target.arch: a CUDA target's is its capability as an int (80), got {self.arch!r}"
            )

    @property
    def sm90_ptx(self) -> bool:
        """Whether sm_90 instructions run (programmatic dependent launch, the bulk L2 prefetch):
        NVIDIA, compute capability 9.0 and later."""
        return self.backend == "cuda" and int(self.arch) >= 90

    @property
    def capability(self) -> tuple[int, int] | None:
        """The CUDA compute capability (None on AMD)."""
        return divmod(int(self.arch), 10) if self.backend == "cuda" else None

    def registers_fit(self, threads: int, registers: int) -> bool:
        """Whether a block of `threads` threads using `registers` each fits one SM's register
        file: NVIDIA allocates per warp, in multiples of register_granule per thread; AMD spreads
        a block's wavefronts over the CU's 4 SIMDs, each with registers_per_sm / 4 / warp_size
        registers per lane."""
        per_thread = -(-registers // self.register_granule) * self.register_granule
        waves = -(-threads // self.warp_size)
        if self.backend == "hip":
            return -(-waves // 4) * per_thread <= self.registers_per_sm // (4 * self.warp_size)
        return waves * self.warp_size * per_thread <= self.registers_per_sm

    @property
    def max_warps(self) -> int:
        """Warps (wavefronts) one block may have."""
        return self.max_threads_per_block // self.warp_size


_NVIDIA: dict[str, Any] = dict(
    backend="cuda", warp_size=32, registers_per_sm=65536, max_registers_per_thread=255
)

# The documented limits (CUDA C Programming Guide, "Technical Specifications per Compute
# Capability"; AMD CDNA3 ISA and the MI300 data sheet). shared_per_block is the opt-in maximum,
# the limit Triton reports as the device's max_shared_mem.
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(name="sm_75", arch=75, shared_per_block=65536, shared_per_sm=65536, max_threads_per_sm=1024,
               bf16=False, gpus="T4, RTX 20xx", **_NVIDIA),
        Target(name="sm_80", arch=80, shared_per_block=166912, shared_per_sm=167936, max_threads_per_sm=2048,
               bf16=True, gpus="A100, A30", **_NVIDIA),
        Target(name="sm_86", arch=86, shared_per_block=101376, shared_per_sm=102400, max_threads_per_sm=1536,
               bf16=True, gpus="A10, A40, RTX 30xx, RTX A6000", **_NVIDIA),
        Target(name="sm_89", arch=89, shared_per_block=101376, shared_per_sm=102400, max_threads_per_sm=1536,
               bf16=True, gpus="L4, L40S, RTX 40xx", **_NVIDIA),
        Target(name="sm_90", arch=90, shared_per_block=232448, shared_per_sm=233472, max_threads_per_sm=2048,
               bf16=True, gpus="H100, H200, GH200", **_NVIDIA),
        Target(name="sm_100", arch=100, shared_per_block=232448, shared_per_sm=233472, max_threads_per_sm=2048,
               bf16=True, gpus="B200, GB200", **_NVIDIA),
        Target(name="sm_120", arch=120, shared_per_block=101376, shared_per_sm=102400, max_threads_per_sm=1536,
               bf16=True, gpus="RTX 50xx, RTX PRO 6000 Blackwell", **_NVIDIA),
        Target(name="gfx942", backend="hip", arch="gfx942", warp_size=64, shared_per_block=65536,
               shared_per_sm=65536, max_threads_per_sm=2048, registers_per_sm=131072,
               max_registers_per_thread=512, bf16=True, gpus="MI300X, MI300A, MI325X"),
    )
}  # fmt: skip

# The targets the offline compile check covers (sm_75 has no bf16 and is not a training target).
CHECKED = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx942")


def target(name: str) -> Target:
    """The target named `name` ("sm_86", "86", "8.6", "gfx942")."""
    key = name.strip().lower()
    if key.replace(".", "").isdigit():
        key = "sm_" + key.replace(".", "")
    elif key.startswith("sm") and not key.startswith("sm_"):
        key = "sm_" + key[2:]
    if key not in TARGETS:
        raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[key]


@functools.cache
def device_target(index: int) -> Target:
    """The target of CUDA (or ROCm) device `index`, from its properties: the known target of its
    name where there is one, with the limits the device itself reports."""
    import torch

    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        arch: int | str = str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
        name, backend = str(arch), "hip"
        bf16 = torch.cuda.is_bf16_supported()
    else:
        major, minor = torch.cuda.get_device_capability(index)
        arch, name, backend = 10 * major + minor, f"sm_{major}{minor}", "cuda"
        bf16 = major >= 8
    known = TARGETS.get(name)
    warp = int(
        getattr(props, "warp_size", 0) or (known.warp_size if known else 64 if backend == "hip" else 32)
    )
    shared = _max_shared(index) or getattr(props, "shared_memory_per_block_optin", 0)
    fields = dict(
        name=name,
        backend=backend,
        arch=arch,
        warp_size=warp,
        shared_per_block=int(shared or (known.shared_per_block if known else 49152)),
        shared_per_sm=int(
            getattr(props, "shared_memory_per_multiprocessor", 0)
            or (known.shared_per_sm if known else shared)
        ),
        max_threads_per_block=int(getattr(props, "max_threads_per_block", 0) or 1024),
        max_threads_per_sm=int(
            getattr(props, "max_threads_per_multi_processor", 0)
            or (known.max_threads_per_sm if known else 1024)
        ),
        registers_per_sm=int(
            getattr(props, "regs_per_multiprocessor", 0) or (known.registers_per_sm if known else 65536)
        ),
        max_registers_per_thread=known.max_registers_per_thread
        if known
        else (512 if backend == "hip" else 255),
        bf16=bf16,
        gpus=props.name,
    )
    return Target(**fields)


def _max_shared(index: int) -> int:
    """The shared memory per block Triton's driver reports (what its launches are checked
    against), or 0."""
    try:
        import triton

        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001  (no driver: the torch property instead)
        return 0


# --- launching as another GPU would --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The target whose launch-time choices the launchers make, and how.

    tables: the tables to launch from (None: the target's own, configs.target_tables).
    compiled: the kernels are compiled for the target (the offline check, which records launches
    on CPU tensors): no software bf16 rounding, PDL as the target has it, whatever device the
    tensors are on. False (a real GPU or the CPU interpreter runs the kernels): those two stay
    the device's own."""

    target: Target
    tables: Tables | None = None
    compiled: bool = False


# The active simulation, or None: read by the launchers (common.pdl, soft_bf16, norms), once per
# launch; a module attribute, not a context variable, for the host cost.
ACTIVE: Simulation | None = None


@contextlib.contextmanager
def simulate(target: Target, tables: Tables | None = None, compiled: bool = False) -> Iterator[Simulation]:
    """Launch as on `target` inside the block (see Simulation). Not thread-safe: for tools."""
    global ACTIVE
    previous = ACTIVE
    ACTIVE = Simulation(target, tables, compiled)
    try:
        yield ACTIVE
    finally:
        ACTIVE = previous
