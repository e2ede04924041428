"""The environment Ray gives the training workers: what torch must read before it starts its process
group or CUDA, so it cannot be set from inside the training loop.

- ``TORCH_FR_BUFFER_SIZE``: torch's flight recorder keeps the last ``run.flight_recorder_entries``
  collectives of every process group (gloo's and NCCL's), which the hang watchdog dumps
  (:mod:`meshtrain.train.hangs`). Off with the watchdog off: nothing would read them.
- ``PYTORCH_CUDA_ALLOC_CONF`` (GPU workers): ``memory.cuda_alloc_conf``, by default
  ``expandable_segments:True``. One the user already set where the driver runs (by hand, or in the
  job's runtime env, which the workers get too) is kept when the setting is left unset, and refused
  when the setting asks for another value: one would otherwise silently override the other.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain.config import ConfigError, RunConfig, ScalingConfig
from meshtrain.config.observability import MemoryConfig

FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# The allocator reads either name (which wins depends on the torch version): a user may have set either.
USER_ALLOC_CONF_ENVS = (ALLOC_CONF_ENV, "PYTORCH_ALLOC_CONF")
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def cuda_alloc_conf(memory: MemoryConfig, environ: Mapping[str, str]) -> str | None:
    """The PYTORCH_CUDA_ALLOC_CONF meshtrain sets for the GPU workers; None leaves the environment's."""
    given = {name: environ[name] for name in USER_ALLOC_CONF_ENVS if name in environ}
    wanted = memory.cuda_alloc_conf
    if wanted is None:
        return None if given else DEFAULT_ALLOC_CONF
    for name, value in given.items():
        if value != wanted:
            raise ConfigError(
                f"memory.cuda_alloc_conf={wanted!r} conflicts with {name}={value!r} in the environment; unset "
                f"{name}, set memory.cuda_alloc_conf to the same value, or leave memory.cuda_alloc_conf unset to "
                "keep the environment's"
            )
    return wanted


def worker_env(run: RunConfig, scaling: ScalingConfig, memory: MemoryConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment variables for every training worker (Ray's ``worker_runtime_env``)."""
    env = {}
    if run.hang_timeout_s is not None and run.flight_recorder_entries:
        env[FLIGHT_RECORDER_ENV] = str(run.flight_recorder_entries)
    if scaling.use_gpu:
        conf = cuda_alloc_conf(memory, environ)
        if conf is not None:
            env[ALLOC_CONF_ENV] = conf
    return env
