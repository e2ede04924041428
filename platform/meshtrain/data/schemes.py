"""The sampling schemes a checkpoint can be trained with (see :mod:`meshtrain.data.sampling`), and the
check that a resumed run reads with its checkpoint's."""

from __future__ import annotations

from meshtrain.config import ConfigError

SAMPLING_SCHEME = "feistel-v2"  # what new runs use
WINDOW_SPLIT_SAMPLING = "feistel-v1"
LEGACY_SAMPLING = "permutation-v0"  # runs whose checkpoints record no scheme were trained with this
SAMPLING_SCHEMES = (SAMPLING_SCHEME, WINDOW_SPLIT_SAMPLING, LEGACY_SAMPLING)


def checkpoint_sampling(manifest: dict, which: str) -> str:
    """The sampling scheme a checkpoint was trained with (``which`` names it in the error): a resumed run
    reads with it, so the data order never changes mid-run. One this meshtrain does not know is refused."""
    scheme = manifest.get("sampling", LEGACY_SAMPLING)  # checkpoints written before the record
    if scheme not in SAMPLING_SCHEMES:
        raise ConfigError(
            f"data: {which} were trained with sampling scheme {scheme!r}, which this meshtrain does not know "
            f"({', '.join(SAMPLING_SCHEMES)}); resume with the meshtrain that wrote them or choose another run.name"
        )
    return scheme
