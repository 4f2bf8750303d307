"""bench_vmm's cases run once each on the host backend, so that the script keeps working (it is run
on the GPU machine, where a failure would only show there)."""

from bench_vmm import bench_backend_ops, bench_page_tables

from kvcached import core


def test_backend_ops_run_and_give_every_handle_back():
    b = core.HostBackend(granularity=2 << 20)
    rows = bench_backend_ops(b, 20, 5)
    assert {r["op"] for r in rows} >= {"map + set access", "release"}
    assert b.stats()["physical_bytes"] == 0


def test_page_tables_run_warm_then_cold_on_one_table():
    """Each table serves the warm case, then the cold one: the cold case must find it usable and
    empty (it closed the table in between and mapped a closed table)."""
    b = core.HostBackend(granularity=2 << 20)
    rows = bench_page_tables(b, b.granularity, (2,), lambda layout, layers: 3)
    assert [(r["layout"], r["cache"]) for r in rows] == [
        ("per_layer", "warm"), ("per_layer", "cold"), ("compound", "warm"), ("compound", "cold")]
    assert rows[0]["mappings_per_page_id"] == 4 and rows[2]["mappings_per_page_id"] == 1
