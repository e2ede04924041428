"""The one typed configuration tree of a meshtrain run: its sections (each in the module of its concern:
``training``, ``evaluation``, ``parallelism``, ``run``, ``observability``, ``data``, ``model``) and the
checks between them.

Pure: it reads no file, store or cluster (``meshtrain.cluster.preflight`` checks those), so it can
be built, printed and validated anywhere, a notebook included.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from meshtrain.config.data import DataConfig
from meshtrain.config.errors import ConfigError
from meshtrain.config.model import ModelArgs, ModelConfig
from meshtrain.config.evaluation import EvalConfig
from meshtrain.config.fault_tolerance import FaultToleranceConfig, check_quorum_outlasts_hangs, check_replica_mode
from meshtrain.config.observability import MemoryConfig, MetricsConfig, ProfileConfig
from meshtrain.config.parallelism import ParallelConfig, ScalingConfig, check_parallel_groups
from meshtrain.config.run import CheckpointConfig, FaultConfig, RunConfig
from meshtrain.config.section import Section
from meshtrain.config.training import OptimConfig, TrainConfig


class MeshtrainConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model shape.")
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus, tokenizer and packing.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and LR schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Steps, batch sizes, seed, logging, step guard.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation loss on held-out data.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="FSDP2 / HSDP layout.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="Ray worker group.")
    run: RunConfig = Field(default_factory=RunConfig, description="Where and under which name outputs go.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Sharded checkpoints and resume.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus metrics and progress output.")
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig, description="What a lost worker costs: a restart, or one replica group."
    )
    fault: FaultConfig = Field(default_factory=FaultConfig, description="Fault injection for tests and demos.")
    profile: ProfileConfig = Field(
        default_factory=ProfileConfig, description="torch.profiler traces of chosen training steps, per rank."
    )
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig, description="The GPU workers' CUDA allocator and memory snapshots."
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> "MeshtrainConfig":
        # Shape checks only: a tokenizer file's vocabulary is known once it is loaded; a trained
        # tokenizer has at most data.vocab_size tokens, so model.vocab_size must hold that many.
        # With model.init_from the shape comes from its config.json: meshtrain.cluster.preflight
        # checks it, with the mesh against the layout and every path, file and store named.
        if self.model.init_from is None:
            tokenizer_vocab = self.data.vocab_size if self.data.tokenizer == "train" else (
                self.model.vocab_size or self.data.vocab_size
            )
            model = self.model.resolved(tokenizer_vocab)
            self.check_seq_len(model)
            self.parallel.check_model(model)
        self._check_parallel_degrees()
        self._check_metrics_ports()
        last = self.data.stages[-1] if self.data.stages else None
        last_end = self.data.stage_ends(self.train.global_batch_size)[-1] if self.data.stages else None
        if last is not None and last_end is not None and last_end < self.train.steps:
            raise ValueError(
                f"data.stages: the last stage, {last.name!r}, ends at step {last_end}, before "
                f"train.steps={self.train.steps}; unset its until_step (or until_tokens) or add a stage after it"
            )
        # TP, CP and PP peers read the same samples: the data-parallel ranks are the workers over PP x TP x CP.
        self.train.batch_layout(self.scaling.num_workers // self.parallel.data_rank_workers)
        if self.parallel.pipeline > 1:
            self._check_pipeline()
        sizes = self.elastic_sizes()
        if self.train.rollback_after_spikes is not None:
            self._check_rollback()
        decaying = [stage.name for stage in self.data.stages or [] if stage.lr_decay_to is not None]
        if self.optim.schedule == "staged" and not self.data.stages:
            raise ValueError("optim.schedule=staged: the LR follows data.stages; give the stages, or another schedule")
        if decaying and self.optim.schedule != "staged":
            raise ValueError(f"data.stages: stage {decaying[0]!r} sets lr_decay_to, which optim.schedule=staged reads; "
                             f"set optim.schedule=staged, or drop lr_decay_to (the schedule is {self.optim.schedule})")
        if self.checkpoint.start_from is not None and self.model.init_from is not None:
            raise ValueError("checkpoint.start_from and model.init_from both give the starting weights; set one "
                             "(start_from: a meshtrain checkpoint, init_from: a Hugging Face directory)")
        if self.fault_tolerance.mode == "replica":
            self.replica_groups()
            check_quorum_outlasts_hangs(self.fault_tolerance, self.run.hang_timeout_s)
        if self.scaling.evict_stragglers:
            if self.fault_tolerance.mode == "replica":
                self._check_replica_eviction_can_happen()
            elif not self.scaling.elastic:
                raise ValueError(
                    "scaling.evict_stragglers=true needs an elastic run to go on without the node: set "
                    "scaling.min_workers below scaling.num_workers, or use fault_tolerance.mode=replica (a slow "
                    "replica group is replaced)"
                )
            else:
                self._check_eviction_can_happen(sizes)
        # A re-run may resolve another horizon (the launcher keeps the first launch's); it checks again.
        self.optim.check_horizon(self.optim.schedule_steps or self.train.steps, self.lr_decay_start(), self.lr_stages())
        self.profile.check_within(self.train.steps, self.scaling.num_workers)
        self.memory.check_device(self.scaling.use_gpu)
        if (self.eval.downstream.enabled or self.eval.samples.prompts) and not self.checkpoint.enabled:
            raise ValueError("eval.downstream.tasks and eval.samples.prompts work on committed checkpoints; set "
                             "checkpoint.enabled=true, or eval.downstream.tasks=[] and eval.samples.prompts=[]")
        if self.eval.interval is not None and self.data.validation.fraction == 0 and self.data.validation.source is None:
            raise ValueError(
                f"eval.interval={self.eval.interval} needs validation data; set data.validation.fraction (e.g. 0.01) "
                "or data.validation.source, or eval.interval=null to turn validation off"
            )
        fault = self.fault
        if fault.node is not None and (fault.kind != "slow" or fault.at_step is None):
            raise ValueError("fault.node is for fault.kind=slow with fault.at_step; set those, or unset fault.node")
        if fault.node is None and (fault.kill_rank is None) != (fault.at_step is None):
            raise ValueError("fault.kill_rank and fault.at_step go together; set both or neither")
        if fault.kill_rank is not None and fault.kill_rank >= self.scaling.num_workers:
            raise ValueError(
                f"fault.kill_rank={fault.kill_rank} is not a worker rank; use 0..{self.scaling.num_workers - 1}"
            )
        if fault.during_checkpoint and fault.at_step is not None:
            if not self.checkpoint.enabled or (
                fault.at_step % self.checkpoint.interval and fault.at_step != self.train.steps
            ):
                raise ValueError(
                    f"fault.at_step={fault.at_step} is not a checkpoint step; with fault.during_checkpoint "
                    f"use a multiple of checkpoint.interval={self.checkpoint.interval}"
                )
        return self

    def replica_groups(self) -> int:
        """fault_tolerance.mode=replica: how many replica groups (model copies) the workers form; ValueError
        when the layout cannot form two or the global batch does not split over the live ones."""
        parallel, scaling = self.parallel, self.scaling
        if not parallel.sharding.replicates:
            raise ValueError(
                f"fault_tolerance.mode=replica replaces whole model copies, the replicate dimension of HSDP; "
                f"parallel.strategy={parallel.strategy} has none: use hybrid_shard (with parallel.shard) or no_shard"
            )
        if parallel.sharding.shards == "none":
            shard = 1
        elif parallel.shard != "auto":
            shard = parallel.shard
        elif scaling.workers_per_node is not None:
            shard = max(1, scaling.workers_per_node // self.parallel.group_size)  # a node's stage, under PP
        else:
            raise ValueError(
                "fault_tolerance.mode=replica needs the size of a replica group: set parallel.shard (data-parallel "
                "ranks per replica), or scaling.workers_per_node (one replica per node)"
            )
        # A replica group is a whole pipeline: its stages, each shard x context x tensor workers.
        return check_replica_mode(
            self.fault_tolerance, scaling.num_workers, shard * self.parallel.data_rank_workers, shard,
            scaling.min_workers not in (None, scaling.num_workers), self._pipeline_runs,
        )

    def _pipeline_runs(self, data_ranks: int) -> object:
        """train.batch_layout over ``data_ranks``, each rank's share whole pipeline runs (ValueError otherwise)."""
        micro, accumulation = self.train.batch_layout(data_ranks)
        if accumulation % self.parallel.microbatches:
            raise ValueError(f"train.global_batch_size={self.train.global_batch_size} over {data_ranks} data-parallel "
                             f"ranks is {accumulation} micro-batches each, not whole pipeline runs of "
                             f"parallel.pipeline_microbatches={self.parallel.microbatches}")
        return micro, accumulation

    def _check_rollback(self) -> None:
        train = self.train
        if not self.checkpoint.enabled:
            raise ValueError(f"train.rollback_after_spikes={train.rollback_after_spikes} rolls back to a committed "
                             "checkpoint; set checkpoint.enabled=true, or unset train.rollback_after_spikes")
        if self.fault_tolerance.mode == "replica":
            raise ValueError("train.rollback_after_spikes works in fault_tolerance.mode=restart; replica groups do not "
                             "roll back yet: unset it, or use fault_tolerance.mode=restart")
        if train.rollback_after_spikes > train.rollback_window:  # type: ignore[operator]
            raise ValueError(
                f"train.rollback_after_spikes={train.rollback_after_spikes} skipped steps cannot happen within "
                f"train.rollback_window={train.rollback_window} steps; raise the window or lower the count"
            )

    def _check_metrics_ports(self) -> None:
        """Each worker serves /metrics on metrics.port + its local rank: the highest must be a port."""
        on_a_node = min(self.scaling.num_workers, self.scaling.workers_per_node or self.scaling.num_workers)
        if self.fault_tolerance.mode == "replica":  # each replica group serves on ports of its own
            on_a_node = self.scaling.num_workers
        highest = self.metrics.port + on_a_node - 1
        if self.metrics.port and highest > 65535:
            raise ValueError(f"metrics.port={self.metrics.port}: the {on_a_node} workers of a node serve on ports "
                             f"{self.metrics.port} to {highest}, beyond 65535; use a port at most {65536 - on_a_node}")

    def _check_parallel_degrees(self) -> None:
        """parallel.tensor / parallel.context against the workers, the nodes, the window and the paths."""
        parallel, scaling, inner = self.parallel, self.scaling, self.parallel.group_size
        if inner == 1 and parallel.pipeline == 1:
            if parallel.async_tensor:
                raise ValueError("parallel.async_tensor needs tensor parallelism; set parallel.tensor > 1 or drop it")
            return
        per_node = scaling.workers_per_node
        check_parallel_groups(parallel.context, parallel.tensor, scaling.num_workers,
                              f"scaling.num_workers={scaling.num_workers}", per_node,
                              f"scaling.workers_per_node={per_node}", parallel.pipeline)
        if inner == 1 and parallel.async_tensor:
            raise ValueError("parallel.async_tensor needs tensor parallelism; set parallel.tensor > 1 or drop it")
        for name, seq_len in self._seq_lens():
            if parallel.context > 1 and seq_len % (2 * parallel.context):
                raise ValueError(f"{name}={seq_len} is not a multiple of 2 x parallel.context="
                                 f"{2 * parallel.context} (each rank holds two balanced chunks of a window); "
                                 "change one of them")
        if parallel.async_tensor and (parallel.tensor == 1 or not scaling.use_gpu or not parallel.compile):
            raise ValueError("parallel.async_tensor needs parallel.tensor > 1, scaling.use_gpu=true and "
                             "parallel.compile=true (inductor pipelines the collectives on CUDA); drop it or set those")

    def _check_pipeline(self) -> None:
        """parallel.pipeline > 1: the step's batch in whole pipeline runs, and what pipeline stages do not run yet."""
        parallel, train = self.parallel, self.train
        ranks = self.scaling.num_workers // parallel.data_rank_workers
        run = train.micro_batch_size * parallel.microbatches * ranks
        if train.global_batch_size % run:
            raise ValueError(
                f"train.global_batch_size={train.global_batch_size} is not a multiple of train.micro_batch_size "
                f"({train.micro_batch_size}) x parallel.pipeline_microbatches ({parallel.microbatches}) x data-parallel "
                f"ranks ({ranks}) = {run}: a step is whole pipeline runs; make it a multiple of {run}")

    def _check_patience_within_run(self) -> None:
        """scaling.evict_stragglers: a straggler can be found before the run ends."""
        patience, every = self.metrics.straggler_patience, self.train.log_every
        if patience * every >= self.train.steps:
            raise ValueError(
                f"scaling.evict_stragglers=true cannot act: metrics.straggler_patience={patience} logged steps of "
                f"train.log_every={every} is {patience * every} steps, not within train.steps={self.train.steps}; "
                "lower metrics.straggler_patience or train.log_every"
            )

    def _check_replica_eviction_can_happen(self) -> None:
        """scaling.evict_stragglers in replica mode: a slow group is ended only while the others stay at
        least fault_tolerance.min_replicas."""
        self._check_patience_within_run()
        groups, least = self.replica_groups(), self.fault_tolerance.min_replicas
        if groups - 1 < least:
            raise ValueError(
                f"scaling.evict_stragglers=true cannot act: ending one of the {groups} replica groups leaves "
                f"{groups - 1}, below fault_tolerance.min_replicas={least}; lower fault_tolerance.min_replicas "
                "or add replica groups"
            )

    def _check_eviction_can_happen(self, sizes: list[int]) -> None:
        """scaling.evict_stragglers with settings under which no straggler could ever be evicted
        (``sizes``: the trainable group sizes, :meth:`elastic_sizes`)."""
        self._check_patience_within_run()
        per_node = self.scaling.workers_per_node
        if per_node is not None and not any(size <= self.scaling.num_workers - per_node for size in sizes):
            raise ValueError(
                f"scaling.evict_stragglers=true cannot act: draining one node of scaling.workers_per_node={per_node} "
                f"leaves {self.scaling.num_workers - per_node} workers, below every trainable size "
                f"{sizes}; lower scaling.min_workers"
            )

    def elastic_sizes(self) -> list[int]:
        """The worker-group sizes a run may train on, smallest first: ``scaling.num_workers`` alone, or
        with ``scaling.min_workers`` every size down to it that is a whole number of shard groups (of
        ``parallel.shard``, or of ``scaling.workers_per_node`` with shard=auto) and divides the global
        batch. ValueError when an elastic setting cannot shrink."""
        scaling = self.scaling
        if scaling.min_workers is None or scaling.min_workers == scaling.num_workers:
            return [scaling.num_workers]
        if scaling.min_workers > scaling.num_workers:
            raise ValueError(
                f"scaling.min_workers={scaling.min_workers} exceeds scaling.num_workers={scaling.num_workers}; "
                "set it to at most scaling.num_workers (or unset it: not elastic)"
            )
        shard, inner = self.parallel.shard, self.parallel.data_rank_workers
        # The unit of workers a size is a whole number of: each data-parallel rank is a tensor x context
        # group of workers (one worker without TP/CP) in each pipeline stage; a smaller group keeps the
        # stages and has fewer data-parallel ranks (the replicate dimension shrinks).
        if self.parallel.sharding.shards != "group":
            unit = inner  # the shard group is every data-parallel rank (or one): any number holds it
        elif shard != "auto":
            if shard * inner > scaling.min_workers:
                raise ValueError(
                    f"parallel.shard={shard} does not fit scaling.min_workers={scaling.min_workers}: a smaller group "
                    f"could not hold one shard group of {shard * inner} workers; raise scaling.min_workers to "
                    f"{shard * inner} or use parallel.shard=auto"
                )
            unit = shard * inner
        else:
            # Learned from Ray when unset: checked when the group starts.
            unit = scaling.workers_per_node * self.parallel.pipeline if scaling.workers_per_node else inner
        # A data-parallel rank's share of a step is whole pipeline runs (one micro-batch without PP).
        step_samples = self.train.micro_batch_size * self.parallel.microbatches
        sizes = [
            size
            for size in range(scaling.min_workers, scaling.num_workers + 1)
            if size % unit == 0 and self.train.global_batch_size % (size // inner * step_samples) == 0
        ]
        if sizes == [scaling.num_workers]:
            raise ValueError(
                f"scaling.min_workers={scaling.min_workers}: no smaller group than scaling.num_workers="
                f"{scaling.num_workers} is a whole number of shard groups of {unit} whose micro-batches "
                f"(train.micro_batch_size={step_samples}) divide train.global_batch_size={self.train.global_batch_size}; "
                "raise train.global_batch_size to a multiple of more sizes or lower scaling.min_workers"
            )
        return sizes

    def data_cache_url(self) -> str:
        """Where token stores are prepared and found: ``data.cache_dir``, else ``token_stores`` beside the runs."""
        return self.data.cache_dir or str(Path(self.run.storage_path).expanduser().resolve() / "token_stores")

    def lr_decay_start(self) -> int | None:
        """The step optim.decay_from_stage's stage starts at (the step after the stage before it ends)."""
        name = self.optim.decay_from_stage
        if name is None:
            return None
        stages = self.data.stages or []
        index = next((k for k, stage in enumerate(stages) if stage.name == name), None)
        if index is None:
            raise ValueError(f"optim.decay_from_stage: no data.stages stage is named {name!r} "
                             f"(stages: {', '.join(repr(stage.name) for stage in stages) or 'none'})")
        return self.data.stage_ends(self.train.global_batch_size)[index - 1] or 0 if index else 0

    def lr_stages(self) -> tuple[tuple[int | None, float | None], ...]:
        """optim.schedule=staged: each data.stages stage's last step (None: the last, to the end of the schedule)
        and the ratio of optim.lr it decays to (None: it holds); () for the other schedules."""
        if self.optim.schedule != "staged":
            return ()
        stages = self.data.stages or []
        ends = self.data.stage_ends(self.train.global_batch_size)
        return tuple((end, stage.lr_decay_to) for stage, end in zip(stages, ends))

    def _seq_lens(self) -> list[tuple[str, int]]:
        """data.seq_len and each data.stages stage's own, named as settings."""
        stages = self.data.stages or []
        return [("data.seq_len", self.data.seq_len),
                *((f"data.stages[{k}].seq_len", stage.seq_len) for k, stage in enumerate(stages) if stage.seq_len)]

    def check_seq_len(self, model: ModelArgs) -> None:
        """ConfigError when data.seq_len (or a stage's) exceeds the model's RoPE table."""
        name, seq_len = max(self._seq_lens(), key=lambda item: item[1])
        if seq_len > model.max_seq_len:
            fix = "" if self.model.init_from is not None else " or raise model.max_seq_len"
            raise ConfigError(
                f"{name}={seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
                f"lower {name}{fix}"
            )
