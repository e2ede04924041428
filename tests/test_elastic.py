"""Elastic settings without Ray: which group sizes a run may train on, the one-line refusals, and
the resize record a restarted group writes."""

from __future__ import annotations

import pytest

from meshtrain.cli.pretrain import main
from meshtrain.cluster.worker import check_group_size, resize_record
from meshtrain.config import ConfigError, load_config

BATCH = ["scaling.num_workers=8", "train.global_batch_size=32", "train.micro_batch_size=2"]


@pytest.mark.parametrize(
    ("settings", "sizes"),
    [
        ([], [8]),
        (["scaling.min_workers=8"], [8]),
        (["scaling.min_workers=2"], [2, 4, 8]),  # 3, 5, 6, 7: 32 is not a multiple of 2 x size
        (["scaling.min_workers=2", "parallel.shard=2"], [2, 4, 8]),
        (["scaling.min_workers=4", "scaling.workers_per_node=4"], [4, 8]),
        (["scaling.min_workers=1", "parallel.strategy=full_shard"], [1, 2, 4, 8]),
    ],
)
def test_allowed_sizes(settings: list[str], sizes: list[int]) -> None:
    assert load_config(None, [*BATCH, *settings]).elastic_sizes() == sizes


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["scaling.min_workers=9"], "scaling.min_workers=9 exceeds scaling.num_workers=8; set it to at most"),
        (["scaling.min_workers=5"], "scaling.min_workers=5: no smaller group than scaling.num_workers=8 is"),
        (["scaling.min_workers=2", "parallel.shard=4"], "parallel.shard=4 does not fit scaling.min_workers=2"),
        (["scaling.min_workers=0"], "scaling.min_workers"),
        (["scaling.resize_check_interval_s=0"], "scaling.resize_check_interval_s"),
    ],
)
def test_bad_elastic_settings_exit_2_with_one_line(
    settings: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BATCH, *settings])
    assert main(["--dry-run", *BATCH, *settings]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_dry_run_lists_the_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run", *BATCH, "scaling.min_workers=2"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("elastic:"))
    assert "trains on 2 (accumulation 8), 4 (accumulation 4), 8 (accumulation 2) workers" in line


def test_a_size_ray_offers_but_the_run_cannot_use_fails_its_start() -> None:
    cfg = load_config(None, [*BATCH, "scaling.min_workers=2"])
    check_group_size(cfg, 4)
    with pytest.raises(ConfigError, match="Ray started 6 workers, but .* trains only on 2, 4, 8"):
        check_group_size(cfg, 6)


def test_resize_records_say_why() -> None:
    cfg = load_config(None, [*BATCH, "scaling.min_workers=2"])
    start = {"launch": "a", "world_size": 8, "workers": []}
    assert resize_record(None, "a", 8, cfg) is None
    assert resize_record(start, "a", 8, cfg) is None
    lost = resize_record(start, "a", 4, cfg)
    assert lost is not None and (lost["from_workers"], lost["to_workers"]) == (8, 4)
    assert lost["reason"].startswith("capacity lost")
    grown = resize_record({**start, "world_size": 4}, "a", 8, cfg)
    assert grown is not None and grown["reason"].startswith("capacity returned")
    relaunched = resize_record(start, "b", 4, cfg)
    assert relaunched is not None and relaunched["reason"].startswith("a new launch")
