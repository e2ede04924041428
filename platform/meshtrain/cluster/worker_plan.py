"""The one place the driver turns the checked config into the workers' plan (``train.plan.WorkerPlan``).

It imports no Ray, so the dry run, the one-process benchmarks and the tests build the same plan the
launcher ships.
"""

from __future__ import annotations

from meshtrain.checkpoint.start_point import StartPoint
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan, TrainingData
from meshtrain.data.stages import data_stages
from meshtrain.distributed.plan import planned_split
from meshtrain.model.args import model_args
from meshtrain.train.plan import WorkerPlan


def worker_plan(config: MeshtrainConfig, data: DataPlan | TrainingData, launch_id: str = "",
                start_from: StartPoint | None = None) -> WorkerPlan:
    """The plan of ``config`` (checked, with run.name and optim.schedule_steps resolved by the launcher
    when it launches) for ``data`` (its tokenizer's vocabulary sizes the model)."""
    args = model_args(config.model, data.vocab_size)
    return WorkerPlan(
        model=args,
        data=data,
        horizon=config.optim.schedule_steps or config.train.steps,
        group_sizes=tuple(config.elastic_sizes()),
        replica_groups=config.replica_groups() if config.fault_tolerance.mode == "replica" else None,
        settings=config.model_dump(mode="json"),
        launch_id=launch_id,
        data_stages=data_stages(config.data, config.train.global_batch_size),
        lr_decay_start=config.lr_decay_start(),
        lr_stages=config.lr_stages(),
        start_from=start_from,
        pipeline_split=planned_split(args, config.parallel, config.scaling, config.train, config.data.longest_seq_len(),
                                     config.model.document_mask),
        model_config=config.model,
        data_config=config.data,
        optim=config.optim,
        train=config.train,
        eval=config.eval,
        parallel=config.parallel,
        scaling=config.scaling,
        run=config.run,
        checkpoint=config.checkpoint,
        metrics=config.metrics,
        fault_tolerance=config.fault_tolerance,
        fault=config.fault,
        profile=config.profile,
        memory=config.memory,
    )
