"""The pure layout functions and ParallelConfig, without processes, against an independent enumeration."""

from __future__ import annotations

import pytest
from layout_oracle import MODE_AXES, all_layouts, expected_groups, factorizations
from pydantic import ValidationError

from rlightning_comm import ParallelConfig
from rlightning_comm.topology import node_partitions, parallel_partitions, weight_transfer_ranks


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_layout_matches_the_coordinate_oracle(world_size: int) -> None:
    layouts = all_layouts(world_size)
    assert len(layouts) == 6 * len(factorizations(world_size)) > 0
    for tp, sp, dp, order in layouts:
        expected = expected_groups(world_size, tp, sp, dp, order)
        for derive in (True, False):
            config = ParallelConfig(
                tensor_parallel_size=tp,
                sequence_parallel_size=sp,
                data_parallel_size=None if derive else dp,
                order=order,
                bind_train_data_parallel=True,
            )
            got = parallel_partitions(config, world_size)
            assert set(got) == set(MODE_AXES)
            for mode, groups in got.items():
                assert [list(g) for g in groups] == expected[mode], (tp, sp, dp, order, mode)


def test_megatron_example_layout() -> None:
    # The layouts guide's table (docs/layouts.md): world 8, tp 2, sp 2, order tp-sp-dp.
    got = parallel_partitions(
        ParallelConfig(tensor_parallel_size=2, sequence_parallel_size=2, bind_train_data_parallel=True), 8
    )
    assert got["TENSOR_PARALLEL"] == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert got["SEQUENCE_PARALLEL"] == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert got["DATA_PARALLEL"] == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert got["TRAIN_DATA_PARALLEL"] == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_train_data_parallel_only_on_request() -> None:
    assert "TRAIN_DATA_PARALLEL" not in parallel_partitions(ParallelConfig(), 4)


@pytest.mark.parametrize(
    ("kwargs", "world_size", "match"),
    [
        ({"tensor_parallel_size": 3}, 4, r"world size 4 is not divisible by .* 3 x 1 = 3"),
        ({"tensor_parallel_size": 2, "sequence_parallel_size": 4}, 4, r"world size 4 .* 2 x 4 = 8"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 3}, 4, r"2 x 1 x 3 = 6 must equal the world size 4"),
        ({"data_parallel_size": 2}, 1, r"1 x 1 x 2 = 2 must equal the world size 1"),
    ],
)
def test_sizes_that_do_not_tile_the_world_are_rejected(kwargs: dict, world_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parallel_partitions(ParallelConfig(**kwargs), world_size)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"sequence_parallel_size": -2}, "sequence_parallel_size"),
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size"),
        ({"tensor_parallel_size": "2"}, "tensor_parallel_size"),
        ({"order": "tp-dp"}, "order"),
        ({"order": "tp-sp-dp-pp"}, "order"),
        ({"order": "tp-tp-dp"}, "order"),
        ({"tensor_parallel": 2}, "tensor_parallel"),
    ],
)
def test_bad_config_is_rejected_at_construction(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        ParallelConfig(**kwargs)


def test_config_is_frozen() -> None:
    config = ParallelConfig()
    with pytest.raises(ValidationError):
        config.tensor_parallel_size = 2  # type: ignore[misc]


def test_node_partitions_contiguous_and_interleaved() -> None:
    # 3 nodes x 2: rank r on node r // 2 (torchrun's numbering), then on node r % 3.
    contiguous = node_partitions([(r // 2, r % 2, 2) for r in range(6)])
    assert contiguous == {"INTRA_NODE": ((0, 1), (2, 3), (4, 5)), "INTER_NODE": ((0, 2, 4), (1, 3, 5))}
    interleaved = node_partitions([(r % 3, r // 3, 2) for r in range(6)])
    assert interleaved == {"INTRA_NODE": ((0, 3), (1, 4), (2, 5)), "INTER_NODE": ((0, 1, 2), (3, 4, 5))}


@pytest.mark.parametrize(
    ("placements", "match"),
    [
        ([(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1)], r"uneven nodes: .*LOCAL_WORLD_SIZE \[3\].*\[1\] on ranks \[3\]"),
        ([(0, 0, 2), (0, 1, 2), (0, 1, 2), (1, 0, 2)], r"uneven nodes: .*ranks per node \{0: 3, 1: 1\}"),
        ([(0, 0, 2), (0, 1, 2), (2, 0, 2), (2, 1, 2)], r"node ranks must be 0 \.\. 1 .* got \[0, 2\]"),
        ([(0, 0, 2), (0, 0, 2), (1, 0, 2), (1, 1, 2)], r"node 0: local ranks must be 0 \.\. 1 once each; got \[0, 0\]"),
        ([], r"got none"),
    ],
)
def test_bad_node_placements_are_rejected(placements: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        node_partitions(placements)


def test_weight_transfer_ranks() -> None:
    assert weight_transfer_ranks(2, [3, 0], 4) == (2, 3, 0)  # declared order: the source is group rank 0
    with pytest.raises(ValueError, match=r"src=1 must not be one of dst_ranks \[1, 2\]"):
        weight_transfer_ranks(1, [1, 2], 4)
    with pytest.raises(ValueError, match=r"dst_ranks\[1\]=4 is out of range for world size 4"):
        weight_transfer_ranks(0, [1, 4], 4)
    with pytest.raises(ValueError, match=r"must not repeat"):
        weight_transfer_ranks(0, [1, 1], 4)
    with pytest.raises(ValueError, match=r"at least one destination"):
        weight_transfer_ranks(0, [], 4)
    with pytest.raises(TypeError, match=r"src must be an int"):
        weight_transfer_ranks(True, [1], 4)
    with pytest.raises(TypeError, match=r"dst_ranks must be a list"):
        weight_transfer_ranks(0, 1, 4)  # type: ignore[arg-type]
