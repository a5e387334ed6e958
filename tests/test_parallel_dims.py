from megascope.trainer.parallel.parallel_dims import ParallelDims


def test_rank_layout_is_megatron_order():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.world_size == 8
    assert dims.coords(0) == dims.coords(0)
    c = dims.coords(5)
    assert (c.pp, c.dp, c.tp) == (1, 0, 1)
    for rank in range(8):
        c = dims.coords(rank)
        assert dims.rank_of(c.pp, c.dp, c.tp) == rank


def test_groups_partition_the_world():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    for kind in ("tp", "dp", "pp"):
        groups = dims.group_ranks(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(8)), kind
    assert dims.peers("tp", 5) == [4, 5]
    assert dims.peers("dp", 5) == [5, 7]
    assert dims.peers("pp", 5) == [1, 5]
