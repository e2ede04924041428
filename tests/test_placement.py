"""Where Ray put the ranks: every HSDP shard group must sit on one node (pure function, no processes)."""

from __future__ import annotations

import pytest

from meshtrain.config import ConfigError
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.mesh import check_shard_placement, shard_groups_off_node

HSDP_2X2 = MeshPlan(2, 2, True)


@pytest.mark.parametrize(
    ("plan", "nodes", "split"),
    [
        (HSDP_2X2, [0, 0, 1, 1], {}),  # one group per node
        (HSDP_2X2, [1, 1, 0, 0], {}),  # node numbers need not follow rank order
        (HSDP_2X2, [0, 1, 0, 1], {0: [0, 1], 1: [0, 1]}),  # interleaved: both groups split
        (MeshPlan(3, 2, True), [0, 0, 0, 1, 1, 1], {1: [0, 1]}),  # the middle group spans two nodes
        (MeshPlan(2, 2, True), [0, 0, 0, 1], {1: [0, 1]}),  # uneven nodes (3 + 1 workers)
        (MeshPlan(2, 4, True), [0, 0, 0, 0, 0, 0, 1, 1], {1: [0, 1]}),  # uneven nodes (6 + 2)
        (MeshPlan(4, 2, True), [0, 0, 0, 0, 1, 1, 1, 1], {}),  # groups smaller than a node stay on it
    ],
)
def test_groups_off_node(plan: MeshPlan, nodes: list[int], split: dict[int, list[int]]) -> None:
    assert shard_groups_off_node(plan, nodes) == split


def test_placements_must_cover_the_mesh() -> None:
    with pytest.raises(ValueError, match="3 placements for a 2x2 mesh"):
        shard_groups_off_node(HSDP_2X2, [0, 0, 1])


def test_good_placement_reports_that_it_was_checked() -> None:
    assert check_shard_placement(HSDP_2X2, [0, 0, 1, 1], "auto") == (
        "[meshtrain] placement: each of the 2 shard groups of 2 ranks is on one node"
    )
    assert check_shard_placement(MeshPlan(4, 2, True), [0] * 4 + [1] * 4, 2) is not None


@pytest.mark.parametrize(
    ("plan", "nodes"),
    [
        (MeshPlan(1, 4, True), [0, 0, 1, 1]),  # one group over every worker: plain FSDP, spans by design
        (MeshPlan(4, 1, True), [0, 1, 0, 1]),  # groups of one rank cannot span
    ],
)
def test_nothing_to_check(plan: MeshPlan, nodes: list[int]) -> None:
    assert check_shard_placement(plan, nodes, "auto") is None


def test_auto_shard_refuses_a_group_across_nodes() -> None:
    with pytest.raises(ConfigError) as caught:
        check_shard_placement(HSDP_2X2, [0, 1, 0, 1], "auto")
    assert str(caught.value) == (
        "parallel.shard=auto: Ray placed shard groups across nodes (group 0 (ranks 0-1) on nodes 0,1; "
        "group 1 (ranks 2-3) on nodes 0,1), so their all-gathers would go over the network; keep "
        "scaling.placement_strategy=PACK (or STRICT_PACK) with whole nodes of workers, or set parallel.shard "
        "explicitly to accept it"
    )
    assert "\n" not in str(caught.value)


def test_explicit_shard_warns_and_goes_on() -> None:
    warning = check_shard_placement(MeshPlan(3, 2, True), [0, 0, 0, 1, 1, 1], 2)
    assert warning == (
        "[meshtrain] WARNING: parallel.shard=2: shard groups span nodes (group 1 (ranks 2-3) on nodes 0,1); "
        "their all-gathers go over the network; set parallel.shard to the workers per node (or auto) to keep "
        "them on one node"
    )


def test_many_split_groups_are_summarized_on_one_line() -> None:
    plan = MeshPlan(8, 2, True)
    warning = check_shard_placement(plan, [rank % 2 for rank in range(16)], 2)
    assert warning is not None and "\n" not in warning
    assert "group 3 (ranks 6-7) on nodes 0,1 and 4 more" in warning and "group 4 " not in warning
