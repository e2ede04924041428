"""Recovery at pretraining scale, by arithmetic: what one lost worker costs a 16,384-GPU Llama 3 run in
restart mode (every GPU restarts and reloads the newest checkpoint) and in replica mode (the survivors
stall for a heartbeat timeout and a step, the replacement group receives a live peer's state), and the
goodput each mode gives at the Llama 3 paper's interruption rate.

Every figure is computed from :class:`ScaleInputs` (printed with the results) and the model presets'
shapes; nothing is measured here. First order: a failure during a recovery is not modelled.

What a replica group sends a joining one is what meshtrain keeps per parameter (``train/healing.py``:
the local shards of the model and optimizer state): the fp32 parameter (bf16 is only the compute
dtype) and AdamW's two fp32 moments, 12 bytes. A DCP checkpoint holds the same tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshtrain.config import ModelArgs
from meshtrain.config.loading import load_config

GB = 1e9


@dataclass(frozen=True)
class ScaleInputs:
    gpus: int = 16_384  # Llama 3 405B's cluster (Llama 3 paper, section 3.3)
    gpus_per_node: int = 8
    interruptions: int = 419  # unexpected interruptions in a 54-day snapshot (paper, section 3.3.4, Table 5)
    days: float = 54.0
    # Table 5's "software bug" interruptions: code every replica runs, so taken to end a replica-mode run too
    # (which then resumes from its newest checkpoint, as restart mode does).
    whole_run_interruptions: int = 54
    weight_bytes: int = 4  # fp32 parameters (bf16 compute)
    moment_bytes: int = 8  # AdamW exp_avg + exp_avg_sq, fp32
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    mfu: float = 0.40  # the paper reports 38-43% for 405B
    seq_len: int = 8192
    sequences_per_gpu: int = 1  # per step: HSDP's floor (every data-parallel rank reads a sequence)
    checkpoint_interval_s: float = 900.0
    detect_s: float = 5.0  # fault_tolerance.heartbeat_timeout_s's default; restart mode granted the same
    group_start_s: float = 300.0  # every rank of the 16k-GPU worker group starting again
    replacement_start_s: float = 300.0  # one replica group starting: taken as long as the whole group's
    network_gbit_per_node: float = 400.0  # one 400 Gb/s NIC's worth per node (H100 nodes often have 8)
    storage_gbyte_per_node: float = 5.0  # checkpoint reads (S3 or alike), per node
    storage_tbyte_cluster: float = 2.0  # the storage's sustained aggregate (the paper's Tectonic: 2 TB/s)


@dataclass(frozen=True)
class ModelCase:
    preset: str
    group_nodes: int  # nodes per replica group (the FSDP shard group): its state must fit the GPUs' memory


CASES = (ModelCase("llama3_8b", 1), ModelCase("llama3_70b", 4))


@dataclass(frozen=True)
class ScaleRow:
    preset: str
    parameters: int
    state_bytes: int  # one copy of the model and optimizer state
    group_gpus: int
    replicas: int
    state_bytes_per_gpu: float
    step_s: float
    heal_s: float  # the transfer to a joining group, each node of it receiving its shard at once
    reload_bytes: float  # every replica's GPUs read their shard
    reload_s: float
    redo_s: float
    restart_cost_s: float  # whole-cluster seconds lost per interruption
    local_cost_s: float  # ... per interruption replica mode survives
    replica_cost_s: float  # ... per interruption in replica mode, whole-run ones included
    goodput_restart: float
    goodput_replica: float


def model_shape(preset: str) -> ModelArgs:
    return load_config(None, [f"model.preset={preset}"]).model.resolved(None)


def parameter_count(args: ModelArgs) -> int:
    """The parameters of meshtrain's Llama (``model/llama.py``) of shape ``args``."""
    kv = args.n_kv_heads * args.head_dim
    attention = 2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * kv
    block = attention + 3 * args.dim * args.ffn_dim + 2 * args.dim  # SwiGLU; two RMSNorms
    head = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return args.vocab_size * args.dim + args.n_layers * block + args.dim + head


def mtbf_s(inputs: ScaleInputs) -> float:
    return inputs.days * 86_400 / inputs.interruptions


def goodput(cost_s: float, mtbf: float) -> float:
    """The share of wall time that trains new steps, when each interruption costs ``cost_s`` seconds of
    the whole cluster and they come every ``mtbf`` seconds."""
    return max(0.0, 1.0 - cost_s / mtbf)


def step_seconds(parameters: int, inputs: ScaleInputs) -> float:
    """6 N FLOPs per token (attention left out), each GPU's tokens at ``mfu`` of its peak."""
    tokens = inputs.seq_len * inputs.sequences_per_gpu
    return 6 * parameters * tokens / (inputs.peak_tflops * 1e12 * inputs.mfu)


def evaluate(case: ModelCase, inputs: ScaleInputs) -> ScaleRow:
    parameters = parameter_count(model_shape(case.preset))
    state = parameters * (inputs.weight_bytes + inputs.moment_bytes)
    group_gpus = case.group_nodes * inputs.gpus_per_node
    if inputs.gpus % group_gpus:
        raise ValueError(f"{inputs.gpus} GPUs do not split into replica groups of {group_gpus}")
    replicas = inputs.gpus // group_gpus
    step_s = step_seconds(parameters, inputs)
    per_node = state / case.group_nodes
    heal_s = per_node / (inputs.network_gbit_per_node / 8 * GB)
    reload_bytes = float(state * replicas)
    reload_s = max(per_node / (inputs.storage_gbyte_per_node * GB),
                   reload_bytes / (inputs.storage_tbyte_cluster * 1e12))
    redo_s = inputs.checkpoint_interval_s / 2
    restart_cost = inputs.detect_s + inputs.group_start_s + reload_s + redo_s
    # Survivors: a heartbeat timeout and the step in flight (trained again). They wait for the joining group at
    # their next gradient sum (meshtrain's quorum is synchronous), so the transfer stalls them too. Meanwhile
    # (strict data) they carry the lost group's share: the cluster commits steps at (R - 1) / R of its speed.
    local_cost = inputs.detect_s + step_s + heal_s + inputs.replacement_start_s / replicas
    whole = inputs.whole_run_interruptions / inputs.interruptions
    replica_cost = whole * restart_cost + (1 - whole) * local_cost
    mtbf = mtbf_s(inputs)
    return ScaleRow(
        case.preset, parameters, state, group_gpus, replicas, state / group_gpus, step_s, heal_s, reload_bytes,
        reload_s, redo_s, restart_cost, local_cost, replica_cost, goodput(restart_cost, mtbf),
        goodput(replica_cost, mtbf),
    )


def assumptions(inputs: ScaleInputs) -> list[str]:
    """The inputs, one line each, as printed above the tables."""
    i = inputs
    return [
        f"cluster: {i.gpus:,} GPUs, {i.gpus // i.gpus_per_node:,} nodes of {i.gpus_per_node}",
        f"interruptions: {i.interruptions} in {i.days:g} days (one every {mtbf_s(i) / 3600:.2f} h); "
        f"{i.whole_run_interruptions} of them (software bugs) end a replica-mode run too",
        f"state per parameter: {i.weight_bytes} B fp32 weight + {i.moment_bytes} B AdamW moments = "
        f"{i.weight_bytes + i.moment_bytes} B, sent on healing and read from a checkpoint alike",
        f"step: 6 N FLOPs/token, {i.sequences_per_gpu} x {i.seq_len}-token sequence per GPU, "
        f"{i.peak_tflops:g} TFLOP/s peak at {i.mfu:.0%} MFU",
        f"restart mode: detect {i.detect_s:g} s + group start {i.group_start_s:g} s + checkpoint load + half a "
        f"{i.checkpoint_interval_s:g} s checkpoint interval redone, paid by every GPU",
        f"checkpoint load: {i.storage_gbyte_per_node:g} GB/s per node, {i.storage_tbyte_cluster:g} TB/s for the "
        "whole storage; every GPU reads its shard",
        f"replica mode: heartbeat timeout {i.detect_s:g} s + one step + healing (stalls the survivors) + "
        f"the replacement's start {i.replacement_start_s:g} s at 1/R of the throughput",
        f"healing: {i.network_gbit_per_node:g} Gb/s per node, rank to same rank, every node of the group at once",
        "layout: HSDP, a replica group = one FSDP shard group: "
        + ", ".join(f"{case.preset} {case.group_nodes} node(s)" for case in CASES),
    ]


def format_tables(rows: list[ScaleRow], inputs: ScaleInputs) -> list[str]:
    lines = ["| model | parameters | state (one copy) | replica groups | state per GPU | step | healing: per node, "
             "time | checkpoint reload: all GPUs, time |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.preset} | {r.parameters / 1e9:.2f} B | {r.state_bytes / GB:,.0f} GB | {r.replicas:,} of "
            f"{r.group_gpus} GPUs | {r.state_bytes_per_gpu / GB:.1f} GB | {r.step_s:.2f} s | "
            f"{r.state_bytes / (r.group_gpus // inputs.gpus_per_node) / GB:,.0f} GB, {r.heal_s:.1f} s | "
            f"{r.reload_bytes / 1e12:,.0f} TB, {r.reload_s:.0f} s |"
        )
    lines += ["", "| model | restart: s lost per interruption | replica: s lost per survived one | replica: "
              "mean s lost | goodput restart | goodput replica |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.preset} | {r.restart_cost_s:.0f} (detect {inputs.detect_s:g} + start {inputs.group_start_s:g} + "
            f"load {r.reload_s:.0f} + redo {r.redo_s:.0f}) | {r.local_cost_s:.1f} | {r.replica_cost_s:.0f} | "
            f"{r.goodput_restart:.2%} | {r.goodput_replica:.2%} |"
        )
    lines.append("")
    lines += [f"goal: {r.preset} replica-mode goodput >= 98%: {'yes' if r.goodput_replica >= 0.98 else 'no'} "
              f"({r.goodput_replica:.2%}; restart mode {r.goodput_restart:.2%})" for r in rows]
    return lines


def scale(inputs: ScaleInputs | None = None) -> tuple[list[str], dict[str, object]]:
    """The printed lines (assumptions, tables, goal lines) and the same as JSON."""
    inputs = inputs or ScaleInputs()
    rows = [evaluate(case, inputs) for case in CASES]
    lines = ["assumptions:", *(f"  {line}" for line in assumptions(inputs)), "", *format_tables(rows, inputs)]
    return lines, {"inputs": asdict(inputs), "cases": [asdict(case) for case in CASES],
                   "rows": [asdict(row) for row in rows]}
