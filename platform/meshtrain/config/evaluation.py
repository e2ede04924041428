"""Evaluation settings: validation loss, downstream evaluation and text samples of checkpoints."""

from __future__ import annotations

from pydantic import Field

from meshtrain.config.section import MAX_DURATION_S, Section


class DownstreamEvalConfig(Section):
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks to score committed checkpoints on while training goes on (harness "
        "task names, or task YAML names in include_path); empty = no downstream evaluation. pip install -e '.[eval]'.",
    )
    include_path: str | None = Field(
        None, description="A folder of lm-eval task YAMLs for local data (relative data_files resolve there)."
    )
    every: int = Field(
        1, gt=0, description="Score every N-th periodic checkpoint (steps that are multiples of N x "
        "checkpoint.interval), and the last step's; eval.samples follow the same checkpoints."
    )
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per prompt; null = each task's own.")
    limit: int | None = Field(None, gt=0, description="At most this many examples per task; null = all.")
    batch_size: int = Field(8, gt=0, description="Sequences per forward in the harness.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each evaluation task.")
    num_gpus: float | None = Field(
        None, ge=0, description="GPUs Ray reserves for each evaluation task; null = 1 with scaling.use_gpu, else 0."
    )
    memory_gb: float | None = Field(
        None, gt=0, description="Memory Ray reserves for each evaluation task (GiB); it must hold the model's fp32 "
        "weights (bf16 on a GPU) and the harness's batches. null = no reservation."
    )
    final_wait_s: float = Field(
        1800.0, ge=0, le=MAX_DURATION_S, description="After training, how long the job waits for evaluations still running "
        "(the last checkpoint's); those not done by then keep running and write their results later."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)


class TextSamplesConfig(Section):
    prompts: list[str] = Field(
        default_factory=list,
        description="Prompts whose continuations each scored checkpoint writes (downstream/step-N/text_samples.jsonl, "
        "the trackers, the job log): the quickest human check that training works; empty = none.",
    )
    max_new_tokens: int = Field(64, gt=0, description="New tokens per continuation (it stops earlier at end of document).")
    temperature: float = Field(0.0, ge=0, description="0 = greedy; above 0 samples at this temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (with temperature > 0).")
    seed: int = Field(0, description="Seed of the sampling, so a checkpoint's samples can be drawn again.")


class EvalConfig(Section):
    samples: TextSamplesConfig = Field(
        default_factory=TextSamplesConfig, description="Text continuations of fixed prompts at each scored checkpoint."
    )
    downstream: DownstreamEvalConfig = Field(
        default_factory=DownstreamEvalConfig, description="Downstream tasks (lm-evaluation-harness) on checkpoints."
    )
    interval: int | None = Field(
        50,
        gt=0,
        description="Compute the validation loss every N steps and after the last step; null = never.",
    )
    batches: int = Field(
        4,
        gt=0,
        description="Size of the validation set in global batches (train.global_batch_size sequences each); "
        "the same sequences every time, capped at what data.validation holds.",
    )
