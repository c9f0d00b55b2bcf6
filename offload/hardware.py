"""The simulator's hardware: accelerators with their host link (`HardwarePreset`, `HARDWARE`) and host CPUs
for hybrid execution (`HostPreset`, `HOSTS`), from datasheets and the measurements noted beside each.

Read by the cost model (`offload/cost_model.py`, which also re-exports these names) and the simulator.
"""

from __future__ import annotations

import dataclasses

GiB = 2**30
# The engine's own host costs a preset may carry (`offload/engine_model.py`); zero: not charged.
ENGINE_COSTS = ("launch_s", "launch_argument_s", "sync_s", "layer_host_s", "copy_issue_s")


@dataclasses.dataclass(frozen=True, slots=True)
class HardwarePreset:
    """One accelerator and its host link, as datasheet (nominal) numbers and achieved fractions.

    Attributes:
      name: what the preset describes.
      hbm_bytes_per_s: device-memory bandwidth (HBM or GDDR), nominal.
      flops_per_s: dense bf16 tensor-core peak (no 2:4 sparsity), nominal.
      link_bytes_per_s: host-to-device bandwidth of the link, one direction, nominal.
      memory_bytes: device memory.
      link_efficiency: fraction of `link_bytes_per_s` a pinned-host copy achieves.
      hbm_efficiency: fraction of `hbm_bytes_per_s` memory-bound kernels (GEMV, decode) achieve.
      flops_efficiency: fraction of `flops_per_s` compute-bound kernels (prefill GEMMs) achieve.
      copy_latency_s: fixed cost of one host-to-device copy beside its bytes (the runtime's dispatch, the
        DMA's setup and completion), paid by each chunk of a chunked copy.
      expert_kernel_s: fixed time of one expert's kernels at decode beside its bytes (its three GEMVs and
        the activation: launches and tails that batch-1 work cannot hide).
      attention_kernel_s: likewise for one layer's attention block and router.
      launch_s, launch_argument_s: the engine's host cost of one launch of its step program, and per argument
        of it (every expert's arrays are arguments: `ModelPreset.launch_arguments`); see
        `offload/engine_model.py` for what the simulator charges.
      sync_s: one host read of a launch's results beside the wait for them.
      layer_host_s: the host's serving of one MoE layer's routing (driver, cache, a cheap policy's events).
      copy_issue_s: the host's cost of issuing one expert copy.
    """

    name: str
    hbm_bytes_per_s: float
    flops_per_s: float
    link_bytes_per_s: float
    memory_bytes: int
    link_efficiency: float = 0.8
    hbm_efficiency: float = 0.8
    flops_efficiency: float = 0.7
    copy_latency_s: float = 0.0
    expert_kernel_s: float = 0.0
    attention_kernel_s: float = 0.0
    launch_s: float = 0.0
    launch_argument_s: float = 0.0
    sync_s: float = 0.0
    layer_host_s: float = 0.0
    copy_issue_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("copy_latency_s", "expert_kernel_s", "attention_kernel_s", *ENGINE_COSTS):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("hbm_bytes_per_s", "flops_per_s", "link_bytes_per_s", "memory_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"hardware {self.name!r}: {name} must be positive, got {getattr(self, name)}"
                )
        for name in ("link_efficiency", "hbm_efficiency", "flops_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(
                    f"hardware {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)}"
                )

    def without_engine(self) -> HardwarePreset:
        """This preset with the engine's host costs zero: the link and the kernels alone (replays as they were
        before the engine's costs were charged)."""
        return dataclasses.replace(self, **dict.fromkeys(ENGINE_COSTS, 0.0))

    @property
    def link_effective(self) -> float:
        """Host-to-device bytes per second the simulator's link moves."""
        return self.link_bytes_per_s * self.link_efficiency

    def copy_s(self, nbytes: float, chunks: int = 1) -> float:
        """Seconds of one host-to-device copy of `nbytes` sent in `chunks` pieces, one after the other."""
        return chunks * self.copy_latency_s + nbytes / self.link_effective

    def copy_chunks(self, nbytes: float, pieces: int = 3) -> int:
        """The pieces a copy of `nbytes` goes over the link in when the simulator is left to choose
        (`simulate(chunks=None)`): `pieces` (one per matrix) where each piece's bytes take at least
        `PIECE_MIN_LATENCIES` times the per-copy fixed cost, else 1 (the whole expert at once).

        Pieces let an on-demand load overtake a prefetch between them, but each pays the fixed cost; where
        that cost is a large share of a piece, whole copies are faster (decision "copy pieces",
        `benchmarks/DECISIONS.md`)."""
        piece_s = nbytes / pieces / self.link_effective
        return pieces if piece_s >= PIECE_MIN_LATENCIES * self.copy_latency_s else 1

    def roofline_s(self, bytes_read: float, flops: float) -> float:
        """Seconds of a kernel that reads `bytes_read` from device memory and does `flops`."""
        return max(
            bytes_read / (self.hbm_bytes_per_s * self.hbm_efficiency),
            flops / (self.flops_per_s * self.flops_efficiency),
        )


# PCIe x16 per direction: PCIe 4.0 runs 16 GT/s per lane, PCIe 5.0 32 GT/s, both with 128b/130b encoding, so
# 16 lanes carry 31.5 GB/s (Gen4) and 63.0 GB/s (Gen5) each way (PCI-SIG specifications; NVIDIA datasheets
# quote the two directions together: "PCIe Gen4 64 GB/s", "PCIe Gen5 128 GB/s").
PCIE4_X16 = 16e9 * 16 * 128 / 130 / 8
PCIE5_X16 = 32e9 * 16 * 128 / 130 / 8
# Achieved pinned-host -> device copy rates: ~25 GB/s on Gen4 x16 (CUDA `bandwidthTest`, A100 and RTX 30xx
# hosts: about 80 % of the nominal rate; not measured here). On Gen5 x16, measured with JAX (`jax.device_put`
# of a `pinned_host` array; `python -m benchmarks.link_compute` on an H200 on PCIe 5.0 x16, 2026-11-27,
# `benchmarks/results/link_compute.md`): a straight line through copies of 0.25-256 MB gives 50.8-51.5 GB/s
# (81-82 % of nominal) plus 0.27-0.31 ms per copy, whatever its size. Those two numbers predict every expert
# copy measured there within 25 % (Qwen1.5-MoE's 17 MB expert: 0.70 ms; Mixtral's 352 MB: 7.1 ms; sent one
# matrix at a time, each pays the fixed cost: 1.30 and 8.4 ms). They depend on the host (CPU, NUMA placement,
# IOMMU) and the runtime; measure your own.
PCIE4_EFFICIENCY = 0.8
PCIE5_EFFICIENCY = 0.81
JAX_COPY_LATENCY_S = 0.29e-3
# `HardwarePreset.copy_chunks`: a copy goes in pieces only where each piece's bytes take this many fixed costs
# or more (decision "copy pieces").
PIECE_MIN_LATENCIES = 10.0
# Decode kernels at batch 1 on Hopper, measured in the same run (bf16, one XLA program over 8 layers, so no
# dispatch): an expert costs 30 us beside its bytes, which stream at 87-90 % of HBM3e's rate (a least-squares
# fit over Mixtral, Qwen1.5-MoE, Phi-3.5-MoE, Qwen3-MoE and OLMoE, within 20 % of each); the attention block
# with its router takes 0.06-0.10 ms at 512 cached tokens, almost none of it bytes. At batch 1 the small
# models' layers are thus 5-10x their roofline: the fixed costs are most of a decode iteration.
HOPPER_DECODE = dict(hbm_efficiency=0.88, expert_kernel_s=30e-6, attention_kernel_s=65e-6)

# NVIDIA H100 Tensor Core GPU datasheet (SXM5 80 GB): HBM3 3.35 TB/s; BF16 tensor core 1,979 TFLOPS *with
# sparsity*, so 989 TFLOPS dense; PCIe Gen5.
H100_SXM = HardwarePreset(
    "H100 SXM5 80GB, PCIe 5.0 x16",
    hbm_bytes_per_s=3.35e12,
    flops_per_s=989e12,
    link_bytes_per_s=PCIE5_X16,
    memory_bytes=80 * GiB,
    link_efficiency=PCIE5_EFFICIENCY,
    copy_latency_s=JAX_COPY_LATENCY_S,
    **HOPPER_DECODE,
)
# NVIDIA H200 Tensor Core GPU datasheet (SXM 141 GB): HBM3e 4.8 TB/s; BF16 tensor core 1,979 TFLOPS with
# sparsity, 989 dense; PCIe Gen5.
H200_SXM = HardwarePreset(
    "H200 SXM 141GB, PCIe 5.0 x16",
    hbm_bytes_per_s=4.8e12,
    flops_per_s=989e12,
    link_bytes_per_s=PCIE5_X16,
    memory_bytes=141 * 10**9,
    link_efficiency=PCIE5_EFFICIENCY,
    copy_latency_s=JAX_COPY_LATENCY_S,
    **HOPPER_DECODE,
)
# Same datasheet, H100 PCIe 80 GB: HBM2e 2.0 TB/s; BF16 1,513 TFLOPS with sparsity, 756 dense; PCIe Gen5.
H100_PCIE = HardwarePreset(
    "H100 PCIe 80GB, PCIe 5.0 x16",
    hbm_bytes_per_s=2.0e12,
    flops_per_s=756e12,
    link_bytes_per_s=PCIE5_X16,
    memory_bytes=80 * GiB,
    link_efficiency=PCIE5_EFFICIENCY,
    copy_latency_s=JAX_COPY_LATENCY_S,
    **HOPPER_DECODE,
)
# NVIDIA A100 Tensor Core GPU datasheet (80 GB SXM4): HBM2e 2,039 GB/s; BF16 tensor core 312 TFLOPS dense
# (624 with sparsity); PCIe Gen4.
A100_SXM = HardwarePreset(
    "A100 SXM4 80GB, PCIe 4.0 x16",
    hbm_bytes_per_s=2.039e12,
    flops_per_s=312e12,
    link_bytes_per_s=PCIE4_X16,
    memory_bytes=80 * GiB,
    link_efficiency=PCIE4_EFFICIENCY,
)
# NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A (GeForce RTX 3090): 24 GB GDDR6X at 936 GB/s;
# peak BF16 tensor TFLOPS with FP32 accumulate 71 dense (142 with sparsity); PCIe Gen4 x16.
RTX_3090 = HardwarePreset(
    "GeForce RTX 3090 24GB, PCIe 4.0 x16",
    hbm_bytes_per_s=936e9,
    flops_per_s=71e12,
    link_bytes_per_s=PCIE4_X16,
    memory_bytes=24 * GiB,
    link_efficiency=PCIE4_EFFICIENCY,
)
# `python -m benchmarks.engine_costs --like gpt-oss-20b --layers 24` on this 2-core VM, alone (JAX CPU),
# 2026-11-29 (results/engine_costs_cpu_gpt_oss.json): kernels fit on random-weight models of gpt-oss-20b's
# shape at a quarter of its widths with bf16 experts and their own random routing (a bf16 matrix-vector
# product's rate on a CPU depends on the matrices' shapes: Mixtral-shaped ones at hidden 512 fit 8.7 GB/s
# with 0.28 ms per expert), the link on the engine's own copies, and `launch_s` from decode steps forced to
# store-split routing at a quarter of the experts: relaunching the step program after a miss costs ~9 ms
# here (7.1 beyond its arguments and copies), where a trivial program launches in microseconds (a first
# run, started as the machine was still loaded, gave 12.2 ms with a line below the resident step; rerun
# alone). Measured again in rounds beside the resident step (`relaunch_fit`), alone on a slower day of this
# VM: 6.8 ms (results/engine_costs_cpu_gpt_oss_rerun.json) and 9.8 ms, both resolved; 7.1 is kept. The
# attention's fixed time holds the host's serving of a layer (the same cores run both here).
CPU_MEASURED = dict(
    hbm_bytes_per_s=6.85e9,
    link_bytes_per_s=16.9e9,
    copy_latency_s=0.023e-3,
    expert_kernel_s=0.126e-3,
    attention_kernel_s=1.72e-3,
    launch_s=7.14e-3,
    launch_argument_s=0.233e-6,
    sync_s=2.2e-6,
    layer_host_s=0.0,
)
# The Hopper presets' copy and decode numbers are the measurements above (an H200's, on the H100s too: the
# same link generation and architecture). The others keep assumed efficiencies typical of tuned GEMV/GEMM
# kernels (HBM 0.8, FLOPs 0.7) and no fixed costs: nothing was measured on them. Pass
# `dataclasses.replace(preset, hbm_efficiency=1.0, expert_kernel_s=0.0, ...)` for the ideal roofline.

# This machine's CPU as the "device" (JAX's CPU backend; the "link" is a memcpy into another buffer), so that
# live runs here and the simulator can be compared (`benchmarks/live_replay.py`): every number measured by
# `python -m benchmarks.engine_costs` (results/engine_costs_cpu.json) on random-weight Mixtral-shaped models
# with int4 experts, none on the models live_replay checks it against. FLOPs (prefill only) assumed: two
# cores x 2.5 GHz x 32 FP32 FLOP per cycle. Memory: the VM's.
CPU_2CORE_VM = HardwarePreset(
    "2-core x86 VM (JAX CPU backend)",
    hbm_bytes_per_s=CPU_MEASURED["hbm_bytes_per_s"],
    flops_per_s=2 * 2.5e9 * 32,
    link_bytes_per_s=CPU_MEASURED["link_bytes_per_s"],
    memory_bytes=24 * GiB,
    link_efficiency=1.0,
    hbm_efficiency=1.0,
    **{k: v for k, v in CPU_MEASURED.items() if k not in ("hbm_bytes_per_s", "link_bytes_per_s")},
)

HARDWARE: dict[str, HardwarePreset] = {
    "cpu_2core_vm": CPU_2CORE_VM,
    "h100_sxm": H100_SXM,
    "h100_pcie": H100_PCIE,
    "h200_sxm": H200_SXM,
    "a100_sxm": A100_SXM,
    "rtx_3090": RTX_3090,
}


@dataclasses.dataclass(frozen=True, slots=True)
class HostPreset:
    """The host CPU beside an accelerator, for hybrid execution (experts computed where their weights are).

    Attributes:
      name: what the preset describes.
      mem_bytes_per_s: host memory bandwidth, nominal (channels x transfer rate x 8 bytes).
      flops_per_s: dense FLOPs on bf16 weights (FP32 accumulation), nominal.
      mem_efficiency: fraction of `mem_bytes_per_s` a bf16 GEMV streaming one expert achieves.
      flops_efficiency: fraction of `flops_per_s` an expert's GEMMs achieve (prefill).
      call_latency_s: fixed cost of one host call (dispatch, waking the thread pool), per layer.
      transfer_latency_s: fixed cost of one small activation transfer over the link, each way.
    """

    name: str
    mem_bytes_per_s: float
    flops_per_s: float
    mem_efficiency: float = 0.7
    flops_efficiency: float = 0.5
    call_latency_s: float = 50e-6
    transfer_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for name in ("mem_bytes_per_s", "flops_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"host {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        for name in ("mem_efficiency", "flops_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"host {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("call_latency_s", "transfer_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"host {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")

    def roofline_s(self, bytes_read: float, flops: float) -> float:
        """Seconds of host work that reads `bytes_read` from host memory and does `flops`."""
        return max(
            bytes_read / (self.mem_bytes_per_s * self.mem_efficiency),
            flops / (self.flops_per_s * self.flops_efficiency),
        )


# Host memory: a DDR4/DDR5 channel moves 8 bytes per transfer (JEDEC JESD79-4 / JESD79-5; a DDR5 DIMM's two
# 32-bit subchannels together), so DDR4-3200 gives 25.6 GB/s per channel, DDR5-5600 44.8, DDR5-4800 38.4.
# FLOPs: cores x base clock x FLOP per cycle from the vendors' core descriptions. Assumptions, not datasheet
# values: a bf16 GEMV over one expert reaches 70 % of the nominal bandwidth (STREAM typically reaches 75-85 %
# on these platforms), expert GEMMs 50 % of the vector peak (25 % of AMX's, whose tiles suit large GEMMs);
# a host call costs 50 us and a small transfer 10 us each way (typical launch and PCIe round-trip costs).
#
# A desktop of the RTX 3090's generation: AMD Ryzen 9 5950X (16 Zen 3 cores, 3.4 GHz base, two 256-bit FMA
# pipes: 32 FP32 FLOP/cycle; no bf16 instructions, weights widened in registers), dual-channel DDR4-3200.
DESKTOP_DDR4 = HostPreset(
    "Ryzen 9 5950X, 2x DDR4-3200",
    mem_bytes_per_s=2 * 3200e6 * 8,
    flops_per_s=16 * 3.4e9 * 32,
)
# A current desktop: AMD Ryzen 9 9950X (16 Zen 5 cores, 4.3 GHz base, full-width AVX-512: two 512-bit FMA
# pipes, 64 FP32 FLOP/cycle), dual-channel DDR5-5600 (the platform's rated speed).
DESKTOP_DDR5 = HostPreset(
    "Ryzen 9 9950X, 2x DDR5-5600",
    mem_bytes_per_s=2 * 5600e6 * 8,
    flops_per_s=16 * 4.3e9 * 64,
)
# The host of a DGX H100: Intel Xeon Platinum 8480C (56 cores, 2.0 GHz base, AMX: 1,024 BF16 FLOP/cycle per
# core), 8 channels of DDR5-4800 per socket; one socket (the GPU's NUMA node) computes.
SERVER_8CH = HostPreset(
    "Xeon Platinum 8480C (1 socket), 8x DDR5-4800",
    mem_bytes_per_s=8 * 4800e6 * 8,
    flops_per_s=56 * 2.0e9 * 1024,
    flops_efficiency=0.25,
)
# AMD EPYC 9654 (96 Zen 4 cores, 2.4 GHz base, AVX512_BF16 dot products: 64 bf16 FLOP/cycle on two 256-bit
# pipes), 12 channels of DDR5-4800; one socket.
SERVER_12CH = HostPreset(
    "EPYC 9654 (1 socket), 12x DDR5-4800",
    mem_bytes_per_s=12 * 4800e6 * 8,
    flops_per_s=96 * 2.4e9 * 64,
)

# The same 2-core VM as the host beside CPU_2CORE_VM (hybrid execution on the CPU backend): its measured
# memory rate, the FLOPs assumed above; the call and transfer costs the defaults'.
CPU_2CORE_VM_HOST = HostPreset(
    "2-core x86 VM",
    mem_bytes_per_s=CPU_MEASURED["hbm_bytes_per_s"],
    flops_per_s=2 * 2.5e9 * 32,
    mem_efficiency=1.0,
)

HOSTS: dict[str, HostPreset] = {
    "cpu_2core_vm": CPU_2CORE_VM_HOST,
    "desktop_ddr4": DESKTOP_DDR4,
    "desktop_ddr5": DESKTOP_DDR5,
    "server_8ch": SERVER_8CH,
    "server_12ch": SERVER_12CH,
}
